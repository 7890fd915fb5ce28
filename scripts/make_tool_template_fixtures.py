#!/usr/bin/env python3
"""Writes tests/fixtures/hf/chat-tools/{qwen2.5,qwen3,llama3.1}/: the real chat templates of three
tool-calling checkpoints, each with a tiny tokenizer that has the family's control tokens, and what
Hugging Face transformers' apply_chat_template renders for conversations with OpenAI-style tools,
tool calls and tool results (text and ids), so a Rust test can check our Jinja rendering of these
templates token for token without Python.

Run from the repository root with transformers (5.x), tokenizers and jinja2 installed:
    /work/venv-peft/bin/python scripts/make_tool_template_fixtures.py
Every run re-creates the same files (no randomness; the tokenizer is derived from
tests/fixtures/hf/chat/tokenizer.json, which scripts/make_hf_fixtures.py writes).

    /work/venv-peft/bin/python scripts/make_tool_template_fixtures.py --check
re-loads each written directory, re-runs apply_chat_template on every case and compares text and
ids with expected.json, and also renders every case with a bare jinja2 environment set up the way
transformers sets up its own (trim_blocks, lstrip_blocks, the tojson below, raise_exception, no
None-valued message keys): a second, independent path to the same text.

Where the templates come from (verbatim, byte for byte; sha256 checked below):
  * qwen2.5  = Qwen/Qwen2.5-7B-Instruct, from ggml-org/llama.cpp models/templates/
    Qwen-Qwen2.5-7B-Instruct.jinja (written by llama.cpp's scripts/get_chat_template.py, which
    does sys.stdout.write(tokenizer_config["chat_template"]), so the trailing newline is real), read
    from the fork ye-NX/llama.cpp at commit 1eeb523c3e0c7ffbd59469f5463dcbdecba3535e. Cross-checked
    by eye against two more copies in public repos: a saved Qwen2.5-0.5B-Instruct
    chat_template.jinja and a research script's CHAT_TEMPLATES["qwen25"] for
    Qwen/Qwen2.5-7B-Instruct (same text; that one changes only the generation prompt).
  * qwen3    = Qwen/Qwen3-0.6B (Qwen3-8B has the same template), the revision on the Hub since
    spring 2025 (`message.content is string`, `set content = ''`, `reasoning_content is string`).
    Put together from two public copies that overlap it completely:
      - everything before `{%- if add_generation_prompt %}` is the chat_template of
        akougkas/warpio-cli warpio-docs/ai-docs/model_cards/qwen3:4b.md (a pasted
        tokenizer_config.json of Qwen3-4B-Thinking-2507, commit 3b0a51078da8ac85c7014c1ba4e6c1d6fcfef2e4),
        whose only difference from Qwen3-0.6B/8B is the generation prompt (it always opens `<think>`);
      - the generation-prompt tail (`enable_thinking is defined and enable_thinking is false`) is
        that of ye-NX/llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja (same commit as above).
    The result is identical to a full copy of Qwen/Qwen3-0.6B's tokenizer_config.json chat_template
    pasted in a public markdown log, and its assistant block to the one SkyRL's
    skyrl-train/skyrl_train/utils/templates/README.md quotes as "the official Qwen3 jinja template"
    (Qwen/Qwen3-8B at 895c8d171bc03c30e113cd7a28c02494b5e068b7).
    Note: the llama.cpp copy itself is the first (April 2025) revision, which reads
    `message.content` directly: it raises on an assistant message with content None
    ("argument of type 'NoneType' is not iterable" from `'</think>' in message.content`), so it
    cannot render case (c); the current revision renders a missing/None content as ''.
  * llama3.1 = meta-llama/Llama-3.1-8B-Instruct, from ye-NX/llama.cpp models/templates/
    meta-llama-Llama-3.1-8B-Instruct.jinja (same commit and script as above; trailing newline
    real). Cross-checked by eye against two Python string copies of meta-llama/Meta-Llama-3.1-8B-
    Instruct's template in public research code (one identical, one with only its generation prompt
    changed).

Tokenizers: the tiny byte-level BPE of tests/fixtures/hf/chat (ids 0-2 = <|endoftext|>,
<|im_start|>, <|im_end|>, special) plus the family's added tokens, flagged as in the real
checkpoint:
  * qwen2.5: <tool_call>, </tool_call> (added, special=false, as in Qwen2.5's tokenizer; Qwen2.5
    has no added token for <tool_response> or <think>);
  * qwen3: <tool_call>, </tool_call>, <tool_response>, </tool_response>, <think>, </think>
    (added, special=false, as in Qwen3's tokenizer, ids 151657/151658/151665-151668 there);
  * llama3.1: <|begin_of_text|>, <|end_of_text|>, <|start_header_id|>, <|end_header_id|>,
    <|eom_id|>, <|eot_id|>, <|python_tag|> (special=true), and the real checkpoint's
    post-processor (ByteLevel + TemplateProcessing that prepends <|begin_of_text|>), so encoding
    the rendered text with add_special_tokens=true would give a second BOS: apply_chat_template
    tokenizes with add_special_tokens=False.

Cases (for every family unless said otherwise):
  a_no_tools                  system + user, no tools, generation prompt (regression)
  b_tools                     (a) with the two tools
  c_tool_calls                (b) + assistant (content None, two tool calls) + two tool results
  d_multi_turn                (b) + assistant ("Let me search." + one call) + result + assistant
                              answer + new user message, generation prompt
  e_tool_calls_no_gen_prompt  (c) without the generation prompt
  f_think_tool_call           qwen3 only: assistant content "<think>...</think>\n\nLet me search."
                              + one call after the last user turn (reasoning kept)
  g_think_in_history          qwen3 only: (d) with <think> in the first assistant message, which
                              is before the last user turn (reasoning dropped)
  h_tools_no_system           tools, no system message (Qwen2.5 writes its default system text)
Llama 3.1: its template raises "This model only supports single tool-calls at once!" for an
assistant message with more than one tool call, so its (c) and (e) use one call (call_1) and one
tool result instead of two; every case is rendered with the default tools_in_user_message=true
(tools go into the first user message) and the default date_string "26 Jul 2024".
Messages keep `"content": null` where the OpenAI API gives None: transformers 5 drops every
None-valued key of a message before rendering, so a renderer must treat null like a missing key.
"""

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

OUT = Path("tests/fixtures/hf/chat-tools")
BASE_TOKENIZER = Path("tests/fixtures/hf/chat/tokenizer.json")

# ---- templates, verbatim (see the module docstring for the sources) ----------------------------

QWEN25_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

TEMPLATE_SHA256 = {
    "qwen2.5": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    "qwen3": "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
    "llama3.1": "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
}

QWEN25_ADDED = ["<tool_call>", "</tool_call>"]
QWEN3_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]

FAMILIES = {
    "qwen2.5": dict(template=QWEN25_TEMPLATE, added=QWEN25_ADDED, special=[], bos_prefix=None,
                    config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                            "model_max_length": 131072}),
    "qwen3": dict(template=QWEN3_TEMPLATE, added=QWEN3_ADDED, special=[], bos_prefix=None,
                  config={"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                          "model_max_length": 131072}),
    "llama3.1": dict(template=LLAMA31_TEMPLATE, added=[], special=LLAMA_SPECIAL, bos_prefix="<|begin_of_text|>",
                     config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                             "model_max_length": 131072}),
}

# ---- conversations -----------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web for \"facts\" about <places> & people; it's fast. Café, 日本.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {
                        "type": "string",
                        "description": "What to look up, e.g. \"capital of France\" or <Tōkyō & Ōsaka>.",
                        "minLength": 1,
                    },
                },
                "required": ["query"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "answer",
            "description": "Give the user's final answer (plain text, no <html> & no \"quotes\"). Réponse finale.",
            "parameters": {
                "type": "object",
                "properties": {
                    "text": {"type": "string", "description": "The answer; l'été, 東京."},
                },
                "required": ["text"],
            },
        },
    },
]

SYSTEM = {"role": "system", "content": "You are a careful research assistant. Use the tools when needed."}
USER = {"role": "user", "content": "What is the capital of France, and how many people live there?"}


def call(call_id, query):
    return {"id": call_id, "type": "function", "function": {"name": "search", "arguments": {"query": query}}}


CALL_1 = call("call_1", "capital of France")
CALL_2 = call("call_2", "population of Paris (Île-de-France) \"2024\"")
RESULT_1 = {"role": "tool", "tool_call_id": "call_1", "name": "search",
            "content": "Paris is the capital of France (\"la Ville Lumière\")."}
RESULT_2 = {"role": "tool", "tool_call_id": "call_2", "name": "search",
            "content": "{\"population\": 2102650, \"year\": 2023, \"note\": \"ville de Paris <intra-muros>\"}"}
FINAL = {"role": "assistant", "content": "The capital of France is Paris; about 2.1 million people live there."}
FOLLOW_UP = {"role": "user", "content": "And what about Japan (日本)? Answer in one word."}


def cases(family):
    """(name, messages, tools, add_generation_prompt, note) for a family."""
    single = family == "llama3.1"  # the template raises on more than one call in a message
    calls = [CALL_1] if single else [CALL_1, CALL_2]
    results = [RESULT_1] if single else [RESULT_1, RESULT_2]
    one_call_note = ("Llama 3.1's template raises 'This model only supports single tool-calls at once!' "
                     "for two calls in one message, so this case uses one call and one result") if single else None
    calling = {"role": "assistant", "content": None, "tool_calls": calls}
    talking = {"role": "assistant", "content": "Let me search.", "tool_calls": [CALL_1]}
    out = [
        ("a_no_tools", [SYSTEM, USER], None, True, None),
        ("b_tools", [SYSTEM, USER], TOOLS, True, None),
        ("c_tool_calls", [SYSTEM, USER, calling, *results], TOOLS, True, one_call_note),
        ("d_multi_turn", [SYSTEM, USER, talking, RESULT_1, FINAL, FOLLOW_UP], TOOLS, True, None),
        ("e_tool_calls_no_gen_prompt", [SYSTEM, USER, calling, *results], TOOLS, False, one_call_note),
    ]
    if family == "qwen3":
        thinking = {"role": "assistant",
                    "content": "<think>\nThe user asks two things; I should search first.\n</think>\n\nLet me search.",
                    "tool_calls": [CALL_1]}
        out.append(("f_think_tool_call", [SYSTEM, USER, thinking, RESULT_1], TOOLS, True, None))
        out.append(("g_think_in_history", [SYSTEM, USER, thinking, RESULT_1, FINAL, FOLLOW_UP], TOOLS, True,
                    None))
    out.append(("h_tools_no_system", [USER], TOOLS, True, None))
    return out


# ---- writing -----------------------------------------------------------------------------------

def make_tokenizer(spec):
    from tokenizers import AddedToken, Tokenizer, processors

    tok = Tokenizer.from_file(str(BASE_TOKENIZER))
    if spec["added"]:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    if spec["special"]:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    if spec["bos_prefix"]:
        bos = spec["bos_prefix"]
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                          special_tokens=[(bos, bos_id)]),
        ])
    return tok


def render(hf, messages, tools, gen_prompt):
    text = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen_prompt, tokenize=False)
    ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=gen_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return text, list(ids)


def write_family(family, spec):
    from transformers import AutoTokenizer

    template = spec["template"]
    assert hashlib.sha256(template.encode()).hexdigest() == TEMPLATE_SHA256[family], family
    directory = OUT / family
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    make_tokenizer(spec).save(str(directory / "tokenizer.json"))
    config = {**spec["config"], "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    hf = AutoTokenizer.from_pretrained(directory)
    out = []
    for name, messages, tools, gen_prompt, note in cases(family):
        text, ids = render(hf, messages, tools, gen_prompt)
        case = {"name": name, "messages": messages, "tools": tools, "add_generation_prompt": gen_prompt,
                "text": text, "ids": ids}
        encoded = hf.encode(text, add_special_tokens=False)
        notes = [note] if note else []
        if encoded != ids:
            notes.append("ids differ from tokenizer.encode(text, add_special_tokens=False)")
        if notes:
            case["note"] = "; ".join(notes)
        out.append(case)
    text = json.dumps({"cases": out}, indent=1, ensure_ascii=False)
    # One line per id list (JSON strings hold no raw newline, so only real lists of ints match)
    text = re.sub(r"\[\n[\d,\s]*\]", lambda m: "[" + ", ".join(re.findall(r"\d+", m.group(0))) + "]", text)
    (directory / "expected.json").write_text(text + "\n")


# ---- checking ----------------------------------------------------------------------------------

def bare_jinja_render(config, messages, tools, gen_prompt):
    """transformers' rendering set-up, rebuilt from its description (utils/chat_template_utils.py):
    sandboxed env with trim_blocks/lstrip_blocks and loopcontrols, json.dumps-based tojson,
    raise_exception, None-valued message keys dropped, special tokens passed as variables."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["namespace"] = jinja2.utils.Namespace
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    specials = {k: config[k] for k in ("bos_token", "eos_token", "pad_token") if config.get(k) is not None}
    return env.from_string(config["chat_template"]).render(
        messages=messages, tools=tools, documents=None, add_generation_prompt=gen_prompt, **specials)


def check():
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    failures = 0
    for family in FAMILIES:
        directory = OUT / family
        config = json.loads((directory / "tokenizer_config.json").read_text())
        assert config["chat_template"] == FAMILIES[family]["template"], f"{family}: template drifted"
        hf = AutoTokenizer.from_pretrained(directory)
        raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
        expected = json.loads((directory / "expected.json").read_text())["cases"]
        names = [c[0] for c in cases(family)]
        assert [c["name"] for c in expected] == names, f"{family}: case list differs"
        for case in expected:
            text, ids = render(hf, case["messages"], case["tools"], case["add_generation_prompt"])
            bare = bare_jinja_render(config, case["messages"], case["tools"], case["add_generation_prompt"])
            raw_ids = raw.encode(case["text"], add_special_tokens=False).ids
            ok = (text == case["text"] and ids == case["ids"] and bare == case["text"] and raw_ids == case["ids"]
                  and raw.decode(case["ids"], skip_special_tokens=False) == case["text"])
            failures += not ok
            print(f"{family}/{case['name']}: {'ok' if ok else 'MISMATCH'} ({len(case['ids'])} tokens)")
    if failures:
        sys.exit(f"{failures} case(s) differ")


def main():
    if sys.argv[1:] == ["--check"]:
        check()
        return
    for family, spec in FAMILIES.items():
        write_family(family, spec)
    for d in sorted(OUT.iterdir()):
        sizes = ", ".join(f"{f.name} {f.stat().st_size / 1024:.1f} KiB" for f in sorted(d.iterdir()))
        print(f"{d}: {sizes}")


if __name__ == "__main__":
    main()

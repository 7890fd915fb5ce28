//! The three pages as HTML strings: the run page (figures per env, the chart area the script
//! fills from `/api/metrics`), the trajectory list (filter form, sortable table, pager) and the
//! trajectory page (steps with observation, coloured response tokens, reward and scores; the
//! group beside it). Every dynamic string goes through [`esc`]; numbers are formatted here.

use std::fmt::Write as _;

use super::html::{esc, num, PageKind, Shell};
use super::index::{Snapshot, SortKey, TrajSummary};
use super::query::{estimator_name, sort_name, Colour, ListQuery, TrajQuery, ESTIMATORS};
use super::source::Source;
use super::trajectory::{short_action, Scoring, StepDetail, TrajectoryDetail};
use crate::store::StepRecord;

fn shell<'a>(kind: PageKind, title: &'a str, root: &'a str, snap: &Snapshot) -> Shell<'a> {
    Shell {
        kind,
        title,
        root,
        generation: snap.generation,
        live: false,
    }
}

/// The training step a trajectory was rolled out for (policy version + 1) in a run; `—` in a
/// bare dataset, which has no training steps.
fn step_of(t: &TrajSummary, is_run: bool) -> String {
    match is_run {
        true => t.policy_version.saturating_add(1).to_string(),
        false => "—".to_string(),
    }
}

/// The run page.
pub fn run_page(source: &Source, snap: &Snapshot) -> String {
    let root = source.root.display().to_string();
    let idx = &snap.index;
    let open = idx.trajs.iter().filter(|t| t.open).count();
    let mut main = format!(
        "<h1>{kind}</h1><p class=\"facts\"><span id=\"records\">{records}</span> step records · \
         <span id=\"trajectories\">{trajs}</span> trajectories ({open} open) · {problems} problems · \
         <a href=\"/trajectories\">browse trajectories</a></p>",
        kind = if source.is_run() { "Run" } else { "Dataset" },
        records = idx.records,
        trajs = idx.trajs.len(),
        problems = snap.problems(),
    );
    main.push_str(&env_table(snap));
    if source.is_run() {
        main.push_str(
            "<h2>Learning curves</h2><p class=\"hint\">Each point links to the trajectories \
             rolled out for that training step.</p><div id=\"charts\" class=\"charts\"></div>\
             <p><label>more: <select id=\"add-metric\"><option value=\"\">add a chart…</option>\
             </select></label></p>",
        );
    } else {
        main.push_str("<p class=\"hint\">A bare dataset: no metrics.jsonl to draw.</p>");
    }
    let mut page = shell(PageKind::Run, "run", &root, snap);
    page.live = true;
    page.wrap(&main)
}

fn env_table(snap: &Snapshot) -> String {
    let mut out = String::from(
        "<table class=\"envs\"><thead><tr><th>env</th><th>finished</th><th>open</th>\
         <th>success</th><th>mean return</th><th>mean length</th></tr></thead><tbody>",
    );
    for f in snap.index.env_figures() {
        let _ = write!(
            out,
            "<tr><td><a href=\"/trajectories?env={q}\">{env}</a></td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td></tr>",
            f.trajectories,
            f.open,
            num(f.success_rate, 3),
            num(f.mean_return, 3),
            num(f.mean_length, 2),
            q = esc(&super::query::encode(&f.env)),
            env = esc(&f.env),
        );
    }
    out.push_str("</tbody></table>");
    out
}

/// The trajectory list: `hits` are positions in the index, already filtered and sorted.
pub fn list_page(source: &Source, snap: &Snapshot, q: &ListQuery, hits: &[u32]) -> String {
    let root = source.root.display().to_string();
    let pages = hits.len().div_ceil(q.per_page).max(1);
    let start = (q.page - 1).saturating_mul(q.per_page).min(hits.len());
    let shown = &hits[start..(start + q.per_page).min(hits.len())];
    let mut main = format!(
        "<h1>Trajectories</h1>{form}<p class=\"facts\" id=\"matches\">{n} match · page {page} of {pages}</p>",
        form = filter_form(snap, q),
        n = hits.len(),
        page = q.page,
    );
    main.push_str(&list_table(snap, q, shown, source.is_run()));
    main.push_str(&pager(q, pages));
    shell(PageKind::List, "trajectories", &root, snap).wrap(&main)
}

fn filter_form(snap: &Snapshot, q: &ListQuery) -> String {
    let f = &q.filter;
    let opt = |v: Option<String>| esc(&v.unwrap_or_default());
    let mut envs = String::from("<option value=\"\">any</option>");
    for env in &snap.index.envs {
        let selected = if f.env.as_deref() == Some(env) {
            " selected"
        } else {
            ""
        };
        let _ = write!(
            envs,
            "<option{selected} value=\"{e}\">{e}</option>",
            e = esc(env)
        );
    }
    let tri = |name: &str, v: Option<bool>, yes: &str, no: &str| {
        let sel = |b: Option<bool>| if v == b { " selected" } else { "" };
        format!(
            "<label>{name} <select name=\"{name}\"><option value=\"\"{}>any</option>\
             <option value=\"true\"{}>{yes}</option><option value=\"false\"{}>{no}</option></select></label>",
            sel(None),
            sel(Some(true)),
            sel(Some(false))
        )
    };
    format!(
        "<form class=\"filters\" method=\"get\" action=\"/trajectories\">\
         <label>env <select name=\"env\">{envs}</select></label>\
         <label>policy version <input name=\"version\" size=\"5\" value=\"{version}\"></label>\
         <label>group <input name=\"group\" size=\"6\" value=\"{group}\"></label>{success}{open}\
         <label>return ≥ <input name=\"min_return\" size=\"5\" value=\"{min_r}\"></label>\
         <label>≤ <input name=\"max_return\" size=\"5\" value=\"{max_r}\"></label>\
         <label>length ≥ <input name=\"min_len\" size=\"3\" value=\"{min_l}\"></label>\
         <label>≤ <input name=\"max_len\" size=\"3\" value=\"{max_l}\"></label>\
         <input type=\"hidden\" name=\"sort\" value=\"{sort}\">\
         <input type=\"hidden\" name=\"order\" value=\"{order}\">\
         <input type=\"hidden\" name=\"per_page\" value=\"{per_page}\">\
         <button type=\"submit\">filter</button> <a href=\"/trajectories\">clear</a></form>",
        version = opt(f.version.map(|v| v.to_string())),
        group = opt(f.group.map(|v| v.to_string())),
        success = tri("success", f.success, "success", "failure"),
        open = tri("open", f.open, "open", "finished"),
        min_r = opt(f.min_return.map(|v| v.to_string())),
        max_r = opt(f.max_return.map(|v| v.to_string())),
        min_l = opt(f.min_len.map(|v| v.to_string())),
        max_l = opt(f.max_len.map(|v| v.to_string())),
        sort = sort_name(q.sort),
        order = if q.desc { "desc" } else { "asc" },
        per_page = q.per_page,
    )
}

fn sort_link(q: &ListQuery, key: SortKey, label: &str) -> String {
    let mut next = q.clone();
    next.desc = q.sort == key && !q.desc;
    next.sort = key;
    let mark = match (q.sort == key, q.desc) {
        (true, false) => " ▲",
        (true, true) => " ▼",
        _ => "",
    };
    format!(
        "<a href=\"/trajectories?{}\">{label}{mark}</a>",
        esc(&next.to_query(1))
    )
}

fn list_table(snap: &Snapshot, q: &ListQuery, shown: &[u32], is_run: bool) -> String {
    let mut out = format!(
        "<table class=\"trajs\" id=\"traj-table\"><thead><tr><th>{}</th><th>{}</th><th>{}</th>\
         <th>step</th><th>{}</th><th>seed</th><th>{}</th><th>{}</th><th>success</th><th>status</th></tr></thead><tbody>",
        sort_link(q, SortKey::Id, "trajectory"),
        sort_link(q, SortKey::Group, "group"),
        sort_link(q, SortKey::Env, "env"),
        sort_link(q, SortKey::Version, "policy version"),
        sort_link(q, SortKey::Length, "steps"),
        sort_link(q, SortKey::Return, "return"),
    );
    for &i in shown {
        let t = &snap.index.trajs[i as usize];
        let _ = write!(
            out,
            "<tr class=\"{cls}\"><td><a href=\"/trajectory/{id}\">{id}</a></td>\
             <td><a href=\"/trajectories?group={g}\">{g}</a></td><td>{env}</td><td>{step}</td>\
             <td>{v}</td><td>{seed}</td><td>{n}</td><td>{ret}</td><td>{ok}</td><td>{status}</td></tr>",
            cls = if t.open { "open" } else { "done" },
            id = t.traj_id,
            g = t.group_id,
            env = esc(snap.index.env_name(t)),
            step = step_of(t, is_run),
            v = t.policy_version,
            seed = t.seed,
            n = t.steps,
            ret = num(f64::from(t.ret), 3),
            ok = if t.success { "✓" } else { "·" },
            status = if t.open { "open" } else { "finished" },
        );
    }
    out.push_str("</tbody></table>");
    out
}

fn pager(q: &ListQuery, pages: usize) -> String {
    let link = |page: usize, label: &str, rel: &str| {
        format!(
            "<a rel=\"{rel}\" href=\"/trajectories?{}\">{label}</a>",
            esc(&q.to_query(page))
        )
    };
    let mut out = String::from("<nav class=\"pager\">");
    if q.page > 1 {
        out.push_str(&link(1, "« first", "first"));
        out.push_str(&link(q.page - 1, "‹ previous", "prev"));
    }
    if q.page < pages {
        out.push_str(&link(q.page + 1, "next ›", "next"));
        out.push_str(&link(pages, "last »", "last"));
    }
    out.push_str("</nav>");
    out
}

/// The trajectory page.
pub fn trajectory_page(
    source: &Source,
    snap: &Snapshot,
    detail: &TrajectoryDetail,
    q: &TrajQuery,
) -> String {
    let root = source.root.display().to_string();
    let t = &detail.summary;
    let title = format!("trajectory {}", t.traj_id);
    let colour = match q.colour {
        Colour::Logprob => "logprob",
        Colour::Advantage => "advantage",
    };
    let mut main = format!(
        "<div class=\"traj\" data-color=\"{colour}\"><article class=\"steps\" id=\"steps\">{head}{controls}{note}",
        head = traj_header(detail, source.is_run()),
        controls = controls(t.traj_id, q),
        note = scoring_note(detail, q),
    );
    for step in &detail.steps {
        main.push_str(&step_section(step));
    }
    main.push_str("</article>");
    main.push_str(&group_aside(detail));
    main.push_str("</div>");
    let mut page = shell(PageKind::Trajectory, &title, &root, snap);
    page.live = t.open;
    page.wrap(&main)
}

fn traj_header(d: &TrajectoryDetail, is_run: bool) -> String {
    let t = &d.summary;
    let version = format!(
        "policy version <a href=\"/trajectories?version={v}\">{v}</a>",
        v = t.policy_version
    );
    let when = match is_run {
        true => format!("training step {} ({version})", step_of(t, true)),
        false => version,
    };
    format!(
        "<h1>Trajectory {id}{open}</h1><p class=\"facts\">group <a href=\"/trajectories?group={g}\">{g}</a> · \
         {env} · seed {seed} · {when} · \
         {n} steps · return {ret} · {ok}</p>",
        id = t.traj_id,
        open = if t.open { " <span class=\"badge open\" id=\"open-badge\">open: no terminal step yet</span>" } else { "" },
        g = t.group_id,
        env = esc(&d.env),
        seed = t.seed,
        n = t.steps,
        ret = num(f64::from(t.ret), 3),
        ok = if t.success { "success" } else { "no success" },
    )
}

fn controls(traj_id: u64, q: &TrajQuery) -> String {
    let current = estimator_name(q.advantage.adv_estimator);
    let mut options = String::new();
    for name in ESTIMATORS {
        let same = super::query::parse_estimator(name).ok() == Some(q.advantage.adv_estimator);
        let selected = if same { " selected" } else { "" };
        let _ = write!(options, "<option{selected}>{name}</option>");
    }
    format!(
        "<form class=\"controls\" method=\"get\" action=\"/trajectory/{traj_id}\">\
         <label>estimator <select name=\"estimator\" id=\"estimator\">{options}</select></label>\
         <button type=\"submit\">score</button> <span class=\"hint\">({cur})</span> \
         <span class=\"toggle\">colour tokens by <button type=\"button\" id=\"color-logprob\">log-prob</button>\
         <button type=\"button\" id=\"color-advantage\">advantage</button></span></form>",
        cur = esc(&current),
    )
}

fn scoring_note(detail: &TrajectoryDetail, q: &TrajQuery) -> String {
    let scoring = &detail.scoring;
    let name = esc(&estimator_name(q.advantage.adv_estimator));
    let text = match scoring {
        Scoring::Scored { over, zero_values } => format!(
            "Value, advantage and return by <b>{name}</b> over the {over} finished trajectories of \
             this group{}. A trainer's batch-wide whitening may differ.",
            if *zero_values { "; no critic is run here, so every value is 0" } else { "" }
        ),
        Scoring::Open => "Not scored: the trajectory is open, its return is not final.".to_string(),
        Scoring::Failed(why) => format!("<b>{name}</b> could not score this group: {}", esc(why)),
    };
    let trained = detail.steps.iter().filter(|s| s.credit.is_some()).count();
    let trainer = match trained {
        0 => String::new(),
        n => format!(
            " The <b>trainer</b> line under {n} of the {} steps is what the run itself used: the \
             critic's value at the step's start, the advantage and return, the step's importance \
             ratio on its first (→ last) pass through the update, and the policy version that \
             sampled it (<code>credit.jsonl</code>); tokens are coloured by that advantage.",
            detail.steps.len()
        ),
    };
    format!("<p class=\"note\" id=\"scoring\">{text}{trainer}</p>")
}

fn step_section(step: &StepDetail) -> String {
    let r = &step.record;
    let scores = match &step.scores {
        Some(s) => format!(
            " · value {} · advantage <span class=\"adv\">{}</span> · return {}",
            num(f64::from(s.value), 3),
            num(f64::from(s.advantage), 3),
            num(f64::from(s.ret), 3)
        ),
        None => String::new(),
    };
    let mut flags = vec![if r.info.action_is_valid {
        "valid"
    } else {
        "invalid"
    }];
    flags.extend(r.info.action_is_effective.then_some("effective"));
    flags.extend(r.info.success.then_some("success"));
    flags.extend(r.info.tool_call_error.then_some("tool call error"));
    flags.extend(r.info.context_rebuilt.then_some("context rebuilt"));
    flags.extend(r.terminated.then_some("terminated"));
    flags.extend((r.truncated && !r.terminated).then_some("truncated"));
    let adv = match (&step.credit, &step.scores) {
        (Some(c), _) => c.advantage,
        (None, Some(s)) => s.advantage,
        (None, None) => 0.0,
    };
    format!(
        "<section class=\"step\" id=\"step-{i}\" data-advantage=\"{adv}\"><h2>Step {i}</h2>\
         <p class=\"facts\">reward <b>{reward}</b>{scores} · {flags} · tokens: context {ctx}, obs {obs}, response {resp}</p>{trainer}\
         <h3>observation</h3><pre class=\"obs\">{obs_text}</pre>{context}\
         <h3>response</h3><div class=\"tokens\">{tokens}</div>{calls}{choices}</section>",
        i = r.step_index,
        adv = if adv.is_finite() { adv } else { 0.0 },
        reward = num(f64::from(r.reward), 3),
        flags = flags.join(", "),
        ctx = r.context_len,
        obs = r.obs_ids.len(),
        resp = r.response_ids.len(),
        obs_text = esc(r.info.observation_text.trim_end()),
        trainer = trainer_line(step),
        context = context_block(step),
        tokens = token_spans(step),
        calls = calls_block(step),
        choices = choices_block(r),
    )
}

/// The admissible actions the response was sampled among (constrained decoding over a state's
/// actions), when the step keeps them.
fn choices_block(r: &StepRecord) -> String {
    if r.admissible_actions.is_empty() {
        return String::new();
    }
    let items: String = (r.admissible_actions.iter())
        .map(|a| format!("<li><code>{}</code></li>", esc(a)))
        .collect();
    format!(
        "<h3>sampled among {} admissible actions</h3><ul class=\"choices\">{items}</ul>",
        r.admissible_actions.len()
    )
}

/// What the run's trainer used for the step (its credit log), when an update consumed it.
fn trainer_line(step: &StepDetail) -> String {
    let Some(c) = &step.credit else {
        return String::new();
    };
    let i = step.record.step_index;
    let value = c
        .value
        .map_or("none (no critic)".to_string(), |v| num(f64::from(v), 3));
    let ratio = match (c.ratio_first, c.ratio_last) {
        (Some(first), Some(last)) if first != last => {
            format!("{} → {}", num(f64::from(first), 3), num(f64::from(last), 3))
        }
        (Some(first), _) => num(f64::from(first), 3),
        _ => "not in the policy loss".to_string(),
    };
    let lag = match c.staleness() {
        0 => "on-policy".to_string(),
        n => format!("{n} behind"),
    };
    format!(
        "<p class=\"facts trainer\" id=\"trainer-{i}\">trainer, update of version {learner}: \
         value <b>{value}</b> · advantage <b>{adv}</b> · return {ret} · ratio {ratio} · \
         sampled by version {behaviour} ({lag}){filtered}</p>",
        learner = c.learner_version,
        adv = num(f64::from(c.advantage), 3),
        ret = num(f64::from(c.ret), 3),
        behaviour = c.behaviour_version,
        filtered = if c.kept {
            ""
        } else {
            " · filtered out of the policy loss"
        },
    )
}

/// The step's new context tokens decoded, collapsible (open where a context starts: that is
/// where the instruction and the task are).
fn context_block(step: &StepDetail) -> String {
    let r = &step.record;
    let after = if r.context_len > 0 {
        format!(", after the {} tokens of the steps before", r.context_len)
    } else {
        String::new()
    };
    format!(
        "<details class=\"context\"{open}><summary>the {n} new context tokens as the model saw \
         them{after}</summary><pre class=\"obs-raw\">{text}</pre></details>",
        open = if r.context_len == 0 { " open" } else { "" },
        n = r.obs_ids.len(),
        text = esc(&step.observation),
    )
}

/// The tool calls of the response, or why its attempted call did not parse.
fn calls_block(step: &StepDetail) -> String {
    match &step.calls {
        Ok(calls) if calls.is_empty() => String::new(),
        Ok(calls) => {
            let items: String = calls
                .iter()
                .map(|c| {
                    format!(
                        "<li><code>{}({})</code></li>",
                        esc(&c.name),
                        esc(&c.arguments)
                    )
                })
                .collect();
            format!("<h3>tool calls</h3><ul class=\"calls\">{items}</ul>")
        }
        Err(why) => format!(
            "<p class=\"note call-error\">tool call did not parse: {}</p>",
            esc(why)
        ),
    }
}

fn token_spans(step: &StepDetail) -> String {
    if step.tokens.is_empty() {
        return format!(
            "<pre class=\"action\">{}</pre>",
            esc(&step.record.info.action_text)
        );
    }
    let mut out = String::with_capacity(step.tokens.len() * 64);
    for tok in &step.tokens {
        let lp = if tok.logprob.is_finite() {
            tok.logprob
        } else {
            0.0
        };
        let _ = write!(
            out,
            "<span class=\"tok\" data-lp=\"{lp}\" title=\"id {id} · {shown} · log-prob {lp:.3}\">{text}</span>",
            id = tok.id,
            shown = esc(&format!("{:?}", tok.text)),
            text = esc(&tok.text),
        );
    }
    out
}

fn group_aside(d: &TrajectoryDetail) -> String {
    let mut out = format!(
        "<aside class=\"group\" id=\"group\"><h2>Group {g}</h2><p class=\"hint\">{n} other \
         {noun} from the same seed: each step's action and reward.</p>",
        g = d.summary.group_id,
        n = d.group.len(),
        noun = if d.group.len() == 1 {
            "trajectory"
        } else {
            "trajectories"
        },
    );
    out.push_str(&mate_line(&d.summary, &own_moves(d), true));
    for m in &d.group {
        out.push_str(&mate_line(&m.summary, &m.moves, false));
    }
    out.push_str("</aside>");
    out
}

fn own_moves(d: &TrajectoryDetail) -> Vec<(String, f32)> {
    d.steps
        .iter()
        .map(|s| (short_action(&s.record.info.action_text), s.record.reward))
        .collect()
}

fn mate_line(t: &TrajSummary, moves: &[(String, f32)], current: bool) -> String {
    let mut out = format!(
        "<div class=\"mate{cur}{ok}\"><a href=\"/trajectory/{id}\">#{id}</a> return {ret}{open}<ol>",
        cur = if current { " current" } else { "" },
        ok = if t.success { " success" } else { "" },
        id = t.traj_id,
        ret = num(f64::from(t.ret), 2),
        open = if t.open { " · open" } else { "" },
    );
    for (action, reward) in moves {
        let _ = write!(
            out,
            "<li><code>{}</code> <span class=\"r\">{}</span></li>",
            esc(action),
            num(f64::from(*reward), 2)
        );
    }
    out.push_str("</ol></div>");
    out
}

/// A page saying what went wrong (the message escaped).
pub fn error_page(root: &str, status: u16, message: &str) -> String {
    let shell = Shell {
        kind: PageKind::Error,
        title: "error",
        root,
        generation: 0,
        live: false,
    };
    shell.wrap(&format!(
        "<h1>{status}</h1><p class=\"error\" id=\"error-message\">{}</p>",
        esc(message)
    ))
}

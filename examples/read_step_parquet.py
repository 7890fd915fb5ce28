"""Read a step dataset exported by `stepppo dataset export` with pyarrow, pandas, polars, DuckDB
and Hugging Face `datasets`, the way a notebook would, and check each against the dataset's
own JSONL replay (`stepppo replay DATASET --format jsonl`).

    stepppo dataset export runs/x/dataset --out steps.parquet --text --advantages step_gae
    stepppo replay runs/x/dataset --format jsonl > steps.jsonl
    python examples/read_step_parquet.py steps.parquet steps.jsonl

Prints one line per library and exits non-zero on the first disagreement.
"""

import json
import sys

import datasets
import duckdb
import pandas as pd
import polars as pl
import pyarrow.parquet as pq


def main(parquet_path, jsonl_path):
    with open(jsonl_path) as f:
        expected = [json.loads(line) for line in f if line.strip()]
    # The export keeps the order the steps were written in; the replay is in trajectory order.
    expected.sort(key=lambda r: (r["traj_id"], r["step_index"]))
    n = len(expected)
    by_key = {(r["traj_id"], r["step_index"]): r for r in expected}

    table = pq.read_table(parquet_path)
    assert table.num_rows == n, (table.num_rows, n)
    assert str(table.schema.field("obs_ids").type) == "list<item: uint32 not null>"
    rows = table.to_pylist()
    for row in rows:
        want = by_key[(row["traj_id"], row["step_index"])]
        for key in ("obs_ids", "response_ids", "env_tag", "terminated", "context_len"):
            assert row[key] == want[key], (key, row[key], want[key])
        assert abs(row["reward"] - want["reward"]) < 1e-6
        assert row["success"] == want["info"]["success"]
        assert row["action_text"] == want["info"]["action_text"]
    print(f"pyarrow: {n} rows, {table.num_columns} columns, every row matches the replay")

    df = pd.read_parquet(parquet_path)
    assert len(df) == n
    assert df["traj_id"].dtype == "uint64" and df["reward"].dtype == "float32"
    returns = df.groupby("traj_id")["reward"].sum()
    want_returns = pd.Series({}, dtype="float64")
    for r in expected:
        want_returns[r["traj_id"]] = want_returns.get(r["traj_id"], 0.0) + r["reward"]
    assert (abs(returns.sort_index().values - want_returns.sort_index().values) < 1e-5).all()
    print(f"pandas: {len(df)} rows, {returns.size} trajectories, mean return {returns.mean():.4f}")

    frame = pl.read_parquet(parquet_path)
    assert frame.height == n and frame.schema["obs_ids"] == pl.List(pl.UInt32)
    tokens = frame.select(pl.col("response_ids").list.len().sum()).item()
    assert tokens == sum(len(r["response_ids"]) for r in expected)
    print(f"polars: {frame.height} rows, {tokens} response tokens")

    [(count, successes)] = duckdb.sql(
        f"SELECT count(*), count(*) FILTER (WHERE success) FROM '{parquet_path}'"
    ).fetchall()
    assert count == n and successes == sum(r["info"]["success"] for r in expected)
    print(f"duckdb: {count} rows, {successes} successful steps")

    ds = datasets.load_dataset("parquet", data_files=parquet_path, split="train")
    assert ds.num_rows == n
    first = ds[0]
    want = by_key[(first["traj_id"], first["step_index"])]
    assert first["obs_ids"] == want["obs_ids"]
    print(f"datasets: {ds.num_rows} rows, features {sorted(ds.features)[:4]}...")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

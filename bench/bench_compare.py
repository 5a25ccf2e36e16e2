"""``steptrace compare`` on real runs: does it separate the code from the machine? (issue 33, item 6)

Each run is a fresh process (like a real launch) training a small torch CPU MLP, one thread, for
``--steps`` steps; every ``--eval-every`` steps an eval (forward passes over held-out batches in
``steptrace.span("eval")``) that the code change under test does not touch. A training step is
``--reps`` forward/backward passes; the "slower code" does ``--slowdown`` more of them (+16 %: 25
against 29 reps). Pairs run one after the other, A then B, as a user compares main with a branch:

* ``A/A quiet``: the same code twice. Must never be flagged.
* ``+16 % quiet``: B's steps do 16 % more work, its eval is unchanged. Must be flagged (exit 1
  under ``--fail-on-regression 10``) in at least 2 of 3 pairs.
* ``A/A, B loaded``: the same code, with ``--load`` busy processes started for B only (the machine
  slowed down: steps and eval both slower). Must exit 0 under ``--fail-on-regression 10`` and
  say the machine changed.

For each pair the script prints the exit code of ``steptrace compare A B --fail-on-regression
10``, the verdict line it printed, and the default metric's change with its interval.

    .venv/bin/python bench/bench_compare.py [--pairs 3] [--steps 150] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import sys, torch, steptrace
run_dir, run_id = sys.argv[1], sys.argv[2]
reps, steps, eval_every = (int(v) for v in sys.argv[3:6])
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
x, y = torch.randn(32, 128), torch.randn(32, 128)
held_out = [torch.randn(32, 128) for _ in range(4)]
steptrace.init(run_dir=run_dir, run_id=run_id, backend="host")
for n in range(steps):
    with steptrace.step(n) as s:
        for _ in range(reps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        s.log(loss=float(loss.detach()))
    if n % eval_every == eval_every - 1:
        with steptrace.span("eval"), torch.no_grad():
            for _ in range(5):
                for batch in held_out:
                    model(batch)
steptrace.shutdown()
"""

BUSY = "import time\nend = time.time() + 600\nwhile time.time() < end:\n    pass\n"


def run_once(run_dir: Path, run_id: str, reps: int, steps: int, eval_every: int, load: int) -> None:
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(load)]
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-c", CHILD, str(run_dir), run_id, str(reps), str(steps), str(eval_every)],
                       check=True, env=env, timeout=600)
    finally:
        for process in busy:
            process.kill()
            process.wait()


def compare(a: Path, b: Path) -> tuple[int, str, dict]:
    from steptrace.analysis.compare import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a), str(b), "--fail-on-regression", "10"])
    with contextlib.redirect_stdout(io.StringIO()) as data:
        main([str(a), str(b), "--json"])
    return code, out.getvalue() + err.getvalue(), json.loads(data.getvalue())


def verdict_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.startswith("Verdict")]
    if lines:
        return lines[0][len("Verdict: "):]
    rows = [line for line in text.splitlines() if line.startswith("step interval, median")]
    return " ".join(rows[0].split()) if rows else "?"


def _pct(row: dict | None, key: str = "relative") -> str:
    return "—" if row is None or row.get(key) is None else f"{row[key] * 100:+.1f} %"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--slowdown", type=float, default=0.16)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--load", type=int, default=2, help="busy processes during B in the loaded pairs")
    parser.add_argument("--scenarios", default="aa,slow,loaded")
    parser.add_argument("--json", default=None)
    parser.add_argument("--keep", default=None, help="keep the runs in this directory")
    args = parser.parse_args()
    slow_reps = round(args.reps * (1 + args.slowdown))
    scenarios = {"aa": ("A/A quiet", args.reps, 0), "slow": (f"+{slow_reps / args.reps - 1:.0%} quiet", slow_reps, 0),
                 "loaded": (f"A/A, B loaded ({args.load} busy)", args.reps, args.load)}
    chosen = [s for s in args.scenarios.split(",") if s]
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.keep or scratch)
        print(f"{'pair':<28} {'exit':>4} {'steps':>9} {'eval':>9}  verdict")
        for k in range(args.pairs):
            for name in chosen:
                label, reps_b, load = scenarios[name]
                run_dir = root / f"{name}-{k}"
                started = time.time()
                run_once(run_dir, "A", args.reps, args.steps, args.eval_every, 0)
                run_once(run_dir, "B", reps_b, args.steps, args.eval_every, load)
                code, text, data = compare(run_dir / "A", run_dir / "B")
                rows = {r["metric"]: r for r in data["rows"]}
                line = verdict_line(text)
                print(f"{label + ' #' + str(k + 1):<28} {code:>4} {_pct(rows.get('interval_median')):>9} "
                      f"{_pct(rows.get('control_eval')):>9}  {line}", flush=True)
                results.append({"scenario": name, "pair": k, "exit": code, "verdict_line": line,
                                "seconds": time.time() - started, "verdict": data.get("verdict"),
                                "rows": {m: rows[m] for m in ("interval_median", "interval_mean", "control_eval")
                                         if m in rows}})
    print()
    for name in chosen:
        codes = [r["exit"] for r in results if r["scenario"] == name]
        print(f"{scenarios[name][0]}: exit 1 in {sum(c == 1 for c in codes)} of {len(codes)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

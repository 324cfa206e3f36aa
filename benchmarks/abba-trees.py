#!/usr/bin/env python3
"""Compare two git revisions of mdcli side by side on this host, in ABBA order.

    python benchmarks/abba-trees.py --before 2f4f3ce --after HEAD --rounds 2 \\
        --out benchmarks/results/restructure-abba

Each revision is checked out with `git worktree add --detach` into /tmp and every job runs as a
real CLI process from that tree (`cwd=<tree>`, `PYTHONPATH=<tree>`, `python -m mdcli ... --jsonl`)
with this same Python (the venv), so each side runs its own code and nothing else differs. At the
start each side prints `mdcli.__file__` and the script refuses to go on unless it lies in that
side's tree (the venv's editable install must not win).

Jobs, on the embedded default model with the CLI's defaults otherwise (threads included, exactly
as a user runs it):
  ask-many  8 questions over examples/story.txt, 64 new tokens
  beam      width 4, a short prompt, 64 new tokens
  margins   one question over examples/story.txt, default settings
  think     a short question, default settings (token limits given explicitly, printed in the report)
`--quick` shrinks every job (2 questions, 8 tokens, ...) to check that the script works.

Per round and job the order is A B B A (before, after, after, before); the pairs (A1, B1) and
(B2, A2) give one after/before ratio each, and the table reports the median of those ratios. Each
run is timed by the wall clock of the whole process and by the `done` event's stats (seconds,
prefill_seconds, decode_seconds; summed when a command emits several). Every run's `finish`
events (branch, label, text, token ids) must be identical across all runs of both sides:
"same tokens".

Before the rounds, each side does one untimed warm-up run (bytecode, native kernels, the embedded
model's converted copy in ~/.cache/mdcli), so no timed run pays a one-off cost.

Writes <out>.md (CPU named at the top, table) and <out>.json (every run's raw numbers; rewritten
after each run, so a stopped benchmark keeps what it measured), then removes the worktrees.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTIONS = [
    "Who is the main character?",
    "Where does the story take place?",
    "What was the fishing boat called?",
    "How many steps did Mara climb every night?",
    "What did Mara ring to guide the fishermen?",
    "What was the weather like that evening?",
    "What did the captain bring Mara?",
    "Why did the captain bring her a gift?",
]
BEAM_PROMPT = "Translate to French: The cat sleeps on the warm windowsill."
MARGINS_QUERY = "Why did the captain thank Mara?"
THINK_QUESTION = (
    "A train leaves a station at 3pm at 60 km/h. A second train leaves the same station at 4pm "
    "at 90 km/h on the same track. At what time does the second train catch up?"
)
# think's token limits, given explicitly so a changed default cannot change the job: the CLI's own
# defaults in both 2f4f3ce and the restructure (4 paths, -n 256 per path, --conclusion-tokens 256).
# On this 2-core AMD EPYC host one such run took 11 s wall (6.6 s in the engine, 261 steps): well
# under the ~60 s budget per run, so no smaller limits are needed. Everything else default.
THINK_PATH_TOKENS = 256
THINK_CONCLUSION_TOKENS = 256


def job_args(story: str, quick: bool) -> dict[str, list[str]]:
    """Each job's CLI arguments after `python -m mdcli` (the --jsonl flag is added by run_one)."""
    n_q, n_tok = (2, 8) if quick else (8, 64)
    ask = ["ask-many", story]
    for q in QUESTIONS[:n_q]:
        ask += ["-q", q]
    ask += ["-n", str(n_tok)]
    beam = ["beam", BEAM_PROMPT, "--width", "4", "-n", str(n_tok)]
    margins = ["margins", story, "-q", MARGINS_QUERY]
    if quick:
        margins += ["-n", "8", "--classify-tokens", "4", "--answer-tokens", "8"]
    think = ["think", THINK_QUESTION]
    if quick:
        think += ["-n", "8", "--conclusion-tokens", "8"]
    else:
        think += ["-n", str(THINK_PATH_TOKENS), "--conclusion-tokens", str(THINK_CONCLUSION_TOKENS)]
    return {"ask-many": ask, "beam": beam, "margins": margins, "think": think}


# ---------------------------------------------------------------------------------------------
# host facts


def cpu_facts() -> dict:
    facts: dict = {"model_name": "unknown", "cpu_family": None, "model": None, "avx512f": False}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return facts
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and facts["model_name"] == "unknown":
            facts["model_name"] = value
        elif key == "cpu family" and facts["cpu_family"] is None:
            facts["cpu_family"] = value
        elif key == "model" and facts["model"] is None:
            facts["model"] = value
    # `grep -c avx512f /proc/cpuinfo`: lines (one flags line per logical CPU) naming avx512f
    facts["avx512f_lines"] = sum(1 for line in text.splitlines() if "avx512f" in line)
    facts["avx512f"] = facts["avx512f_lines"] > 0
    facts["logical_cpus"] = os.cpu_count()
    try:
        facts["affinity_cpus"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    return facts


def cpu_line(c: dict) -> str:
    return (f"{c['model_name']} (family {c['cpu_family']}, model {c['model']}), "
            f"{c.get('logical_cpus')} logical CPUs, AVX-512: {'yes' if c['avx512f'] else 'no'}")


# ---------------------------------------------------------------------------------------------
# git trees


def git(repo: Path, *args: str, check: bool = True) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed:\n{proc.stderr.strip()}")
    return proc.stdout.strip()


def add_tree(repo: Path, sha: str, side: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"abba-{side}-{sha[:10]}-{os.getpid()}"
    if path.exists():
        raise SystemExit(f"{path} exists already; remove it (git worktree remove --force {path})")
    git(repo, "worktree", "add", "--detach", str(path), sha)
    return path


def remove_tree(repo: Path, path: Path) -> None:
    git(repo, "worktree", "remove", "--force", str(path), check=False)
    if path.exists():
        print(f"abba: could not remove {path}", file=sys.stderr)


def side_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def check_import(python: str, tree: Path) -> dict:
    """Where `import mdcli` resolves in this side's environment: it must be this tree."""
    code = ("import mdcli, sys, torch; print(mdcli.__file__); "
            "print(getattr(mdcli, '__version__', '?')); print(torch.__version__); "
            "print(torch.get_num_threads())")
    proc = subprocess.run([python, "-c", code], cwd=tree, env=side_env(tree),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"import mdcli from {tree} failed:\n{proc.stderr[-2000:]}")
    file, version, torch_version, threads = proc.stdout.strip().splitlines()[-4:]
    own = Path(file).resolve().is_relative_to(tree.resolve())
    return {"mdcli_file": file, "mdcli_version": version, "torch": torch_version,
            "torch_threads": int(threads), "own_tree": own}


# ---------------------------------------------------------------------------------------------
# one run


def parse_jsonl(stdout: str) -> tuple[list[dict], list[dict], int]:
    finishes, dones, bad = [], [], 0
    for line in stdout.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if event.get("type") == "finish":
            finishes.append({k: event.get(k) for k in ("branch", "label", "text", "token_ids",
                                                        "finish_reason")})
        elif event.get("type") == "done":
            dones.append(event.get("stats") or {})
    return finishes, dones, bad


def run_one(python: str, tree: Path, args: list[str], timeout: float) -> dict:
    cmd = [python, "-m", "mdcli", *args, "--jsonl"]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=side_env(tree), capture_output=True, text=True,
                              timeout=timeout)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    wall = time.perf_counter() - t0
    finishes, dones, bad = parse_jsonl(out)
    stats = {}
    for key in ("seconds", "prefill_seconds", "decode_seconds", "generated_tokens",
                "prefill_tokens", "forwards", "steps"):
        values = [d[key] for d in dones if isinstance(d.get(key), (int, float))]
        stats[key] = sum(values) if values else None
    ok = rc == 0 and bool(dones) and bool(finishes)
    digest = hashlib.sha256(json.dumps(sorted(finishes, key=lambda f: (f["branch"] or 0,
                                                                         str(f["label"]))),
                                       sort_keys=True).encode()).hexdigest()[:16]
    return {"rc": rc, "ok": ok, "wall_s": round(wall, 4), "loadavg_1m_at_start": round(load, 2),
            "done": stats, "done_events": dones, "finish": finishes, "tokens_digest": digest,
            "bad_lines": bad, "stderr_tail": err[-1500:] if not ok else err[-300:]}


# ---------------------------------------------------------------------------------------------
# report


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def summarize(runs: list[dict], jobs: list[str]) -> list[dict]:
    rows = []
    for job in jobs:
        mine = [r for r in runs if r["job"] == job]
        row = {"job": job, "runs": len(mine), "failed": sum(1 for r in mine if not r["ok"])}
        good = [r for r in mine if r["ok"]]

        def metric(r, name):
            return r["wall_s"] if name == "wall" else r["done"].get(name)

        for name in ("wall", "seconds", "prefill_seconds", "decode_seconds"):
            b = [metric(r, name) for r in good if r["side"] == "before"]
            a = [metric(r, name) for r in good if r["side"] == "after"]
            ratios = []
            for rnd in sorted({r["round"] for r in mine}):
                for pa, pb in (("A1", "B1"), ("A2", "B2")):
                    x = [r for r in good if r["round"] == rnd and r["slot"] == pa]
                    y = [r for r in good if r["round"] == rnd and r["slot"] == pb]
                    if x and y and metric(x[0], name) and metric(y[0], name) is not None:
                        ratios.append(metric(y[0], name) / metric(x[0], name))
            row[name] = {"before_median": median(b), "after_median": median(a),
                         "ratio_median": median(ratios), "ratios": [round(q, 4) for q in ratios],
                         "before": b, "after": a}
        digests = {r["tokens_digest"] for r in mine if r["ok"]}
        row["same_tokens"] = bool(good) and len(good) == len(mine) and len(digests) == 1
        row["digests"] = {side: sorted({r["tokens_digest"] for r in good if r["side"] == side})
                          for side in ("before", "after")}
        rows.append(row)
    return rows


def write_markdown(path: Path, meta: dict, rows: list[dict], runs: list[dict]) -> None:
    c = meta["cpu"]
    L = [f"# ABBA: mdcli {meta['before']['rev']} vs {meta['after']['rev']}", ""]
    L.append(f"- CPU: **{cpu_line(c)}**")
    L.append(f"- Date: {meta['date']}")
    L.append(f"- Before: `{meta['before']['rev']}` = {meta['before']['sha']} "
             f"(mdcli from `{meta['before']['import']['mdcli_file']}`)")
    L.append(f"- After: `{meta['after']['rev']}` = {meta['after']['sha']} "
             f"(mdcli from `{meta['after']['import']['mdcli_file']}`)")
    L.append(f"- Python {meta['python_version']}, torch {meta['before']['import']['torch']}, "
             f"{meta['before']['import']['torch_threads']} torch threads (CLI defaults)")
    L.append(f"- Command: `{meta['command']}`")
    L.append(f"- Rounds: {meta['rounds']}, order per round and job A B B A "
             f"(A = before, B = after); ratio = median over pairs (A1,B1), (B2,A2) of after/before"
             + ("; **--quick** (shrunken jobs: a smoke test, not a measurement)" if meta["quick"]
                else ""))
    L.append(f"- 1-minute load average at the runs' starts: "
             f"{fmt(min(r['loadavg_1m_at_start'] for r in runs))}–"
             f"{fmt(max(r['loadavg_1m_at_start'] for r in runs))}" if runs else "- no runs")
    L += ["", "Wall clock of the whole `python -m mdcli` process (model load included):", ""]
    L.append("| job | before median s | after median s | after/before | same tokens |")
    L.append("|---|---:|---:|---:|---|")
    for row in rows:
        w = row["wall"]
        failed = f" ({row['failed']} of {row['runs']} runs failed)" if row["failed"] else ""
        L.append(f"| {row['job']} | {fmt(w['before_median'])} | {fmt(w['after_median'])} | "
                 f"{fmt(w['ratio_median'], 3)} | {'yes' if row['same_tokens'] else 'no'}{failed} |")
    L += ["", "The `done` event's stats (engine time: seconds = prefill + decode), medians:", ""]
    L.append("| job | before s | after s | after/before | before prefill s | after prefill s "
             "| before decode s | after decode s | decode after/before |")
    L.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        s, p, d = row["seconds"], row["prefill_seconds"], row["decode_seconds"]
        L.append(f"| {row['job']} | {fmt(s['before_median'])} | {fmt(s['after_median'])} | "
                 f"{fmt(s['ratio_median'], 3)} | {fmt(p['before_median'])} | "
                 f"{fmt(p['after_median'])} | {fmt(d['before_median'])} | "
                 f"{fmt(d['after_median'])} | {fmt(d['ratio_median'], 3)} |")
    L += ["", "Jobs (`python -m mdcli <args> --jsonl`, run from each side's tree):", ""]
    for job, args in meta["jobs"].items():
        L.append(f"- {job}: `{shlex.join(args)}`")
    if not meta["quick"]:
        L.append(f"- think token limits: -n {THINK_PATH_TOKENS} per path, "
                 f"--conclusion-tokens {THINK_CONCLUSION_TOKENS} (the CLI's defaults, given "
                 f"explicitly; about 11 s wall per run on a quiet 2-core host); 4 paths and "
                 f"everything else default")
    L += ["", "Every run (wall s / done seconds):", ""]
    L.append("| job | round | slot | side | wall s | done s | prefill s | decode s | load 1m | tokens |")
    L.append("|---|---:|---|---|---:|---:|---:|---:|---:|---|")
    for r in runs:
        d = r["done"]
        L.append(f"| {r['job']} | {r['round']} | {r['slot']} | {r['side']} | {fmt(r['wall_s'])} | "
                 f"{fmt(d.get('seconds'))} | {fmt(d.get('prefill_seconds'))} | "
                 f"{fmt(d.get('decode_seconds'))} | {fmt(r['loadavg_1m_at_start'])} | "
                 f"{r['tokens_digest'] if r['ok'] else 'FAILED rc=' + str(r['rc'])} |")
    path.write_text("\n".join(L) + "\n")


# ---------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="git revision A (e.g. 2f4f3ce)")
    ap.add_argument("--after", required=True, help="git revision B (e.g. HEAD)")
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds per job (default 2)")
    ap.add_argument("--out", default="benchmarks/results/restructure-abba",
                    help="writes <out>.md and <out>.json")
    ap.add_argument("--quick", action="store_true", help="shrink every job (smoke test)")
    ap.add_argument("--jobs", default="ask-many,beam,margins,think",
                    help="comma-separated subset of ask-many,beam,margins,think")
    ap.add_argument("--python", default=sys.executable, help="interpreter (default: this one)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run before it is killed")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run per side")
    ap.add_argument("--keep-trees", action="store_true", help="leave the worktrees in /tmp")
    opts = ap.parse_args()

    repo = Path(git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel"))
    out = Path(opts.out)
    if not out.is_absolute():
        out = Path.cwd() / out
    out.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", *sys.argv])

    sides = {}
    for side, rev in (("before", opts.before), ("after", opts.after)):
        sides[side] = {"rev": rev, "sha": git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}")}

    # One input for both sides: the before revision's story (the after one must be the same file).
    story_text = git(repo, "show", f"{sides['before']['sha']}:examples/story.txt")
    story_after = git(repo, "show", f"{sides['after']['sha']}:examples/story.txt", check=False)
    work = Path(tempfile.mkdtemp(prefix="abba-input-"))
    story = work / "story.txt"
    story.write_text(story_text + "\n")
    jobs_all = job_args(str(story), opts.quick)
    wanted = [j.strip() for j in opts.jobs.split(",") if j.strip()]
    unknown = [j for j in wanted if j not in jobs_all]
    if unknown:
        raise SystemExit(f"unknown job(s): {', '.join(unknown)}")
    jobs = {j: jobs_all[j] for j in wanted}

    def stop(signum, frame):  # SIGTERM: still remove the worktrees
        raise SystemExit(f"abba: stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    trees: dict[str, Path] = {}
    runs: list[dict] = []
    try:
        for side in ("before", "after"):
            trees[side] = add_tree(repo, sides[side]["sha"], side)
            sides[side]["tree"] = str(trees[side])
            imp = check_import(opts.python, trees[side])
            sides[side]["import"] = imp
            print(f"abba: {side:6} {sides[side]['rev']} = {sides[side]['sha'][:10]}  "
                  f"mdcli.__file__ = {imp['mdcli_file']}", file=sys.stderr)
            if not imp["own_tree"]:
                raise SystemExit(f"abba: the {side} side imports mdcli from {imp['mdcli_file']}, "
                                 f"not from its tree {trees[side]}")
        if story_after.strip() != story_text.strip():
            print("abba: note: examples/story.txt differs between the revisions; both sides read "
                  "the before revision's copy", file=sys.stderr)

        cpu = cpu_facts()
        meta = {"command": command, "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                "cpu": cpu, "before": sides["before"], "after": sides["after"], "rounds": opts.rounds,
                "quick": opts.quick, "python": opts.python, "python_version": sys.version.split()[0],
                "jobs": {j: ["python", "-m", "mdcli", *a, "--jsonl"] for j, a in jobs.items()},
                "think_tokens": None if opts.quick else
                {"max_new_tokens": THINK_PATH_TOKENS, "conclusion_tokens": THINK_CONCLUSION_TOKENS},
                "env": {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "OMP_NUM_THREADS",
                                                        "MKL_NUM_THREADS", "MDCLI_CACHE_DIR",
                                                        "MDCLI_DEVICE", "MDCLI_MODEL")}}
        print(f"abba: CPU {cpu_line(cpu)}", file=sys.stderr)

        def save() -> None:
            rows = summarize(runs, list(jobs))
            Path(str(out) + ".json").write_text(json.dumps({"meta": meta, "summary": rows,
                                                            "runs": runs}, indent=1) + "\n")
            if runs:
                write_markdown(Path(str(out) + ".md"), meta, rows, runs)

        if not opts.no_warmup:
            warm_args = ["ask-many", str(story), "-q", QUESTIONS[0], "-n", "2"]
            for side in ("before", "after"):
                t0 = time.perf_counter()
                r = run_one(opts.python, trees[side], warm_args, opts.timeout)
                print(f"abba: warm-up {side}: {time.perf_counter() - t0:.1f} s "
                      f"{'ok' if r['ok'] else 'FAILED rc=' + str(r['rc'])}", file=sys.stderr)
                if not r["ok"]:
                    print(r["stderr_tail"], file=sys.stderr)
                    raise SystemExit(f"abba: the {side} side's warm-up failed")
            meta["warmup"] = {"args": warm_args}

        order = (("A1", "before"), ("B1", "after"), ("B2", "after"), ("A2", "before"))
        started = time.perf_counter()
        for rnd in range(1, opts.rounds + 1):
            for job, args in jobs.items():
                for slot, side in order:
                    r = run_one(opts.python, trees[side], args, opts.timeout)
                    r.update({"job": job, "round": rnd, "slot": slot, "side": side,
                              "rev": sides[side]["rev"]})
                    runs.append(r)
                    d = r["done"]
                    print(f"abba: round {rnd} {job:8} {slot} {side:6} wall {r['wall_s']:7.2f} s  "
                          f"done {fmt(d.get('seconds'))} s (prefill {fmt(d.get('prefill_seconds'))}, "
                          f"decode {fmt(d.get('decode_seconds'))})  load {r['loadavg_1m_at_start']}"
                          f"  tokens {r['tokens_digest'] if r['ok'] else 'FAILED rc=' + str(r['rc'])}",
                          file=sys.stderr)
                    if not r["ok"]:
                        print(r["stderr_tail"], file=sys.stderr)
                    save()
        meta["total_seconds"] = round(time.perf_counter() - started, 1)
        save()
        rows = summarize(runs, list(jobs))
        print(f"\n{out}.md, {out}.json  ({meta['total_seconds']} s of runs)\n", file=sys.stderr)
        print("| job | before median s | after median s | after/before | same tokens |")
        print("|---|---:|---:|---:|---|")
        for row in rows:
            w = row["wall"]
            print(f"| {row['job']} | {fmt(w['before_median'])} | {fmt(w['after_median'])} | "
                  f"{fmt(w['ratio_median'], 3)} | {'yes' if row['same_tokens'] else 'no'} |")
        return 0 if all(row["same_tokens"] and not row["failed"] for row in rows) else 1
    finally:
        if not opts.keep_trees:
            for path in trees.values():
                remove_tree(repo, path)
        for p in (story,):
            p.unlink(missing_ok=True)
        work.rmdir()


if __name__ == "__main__":
    sys.exit(main())

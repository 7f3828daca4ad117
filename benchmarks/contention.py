"""Step time on a shared CPU: quiet, and beside one busy process (issue 25).

    python benchmarks/contention.py                                   # every workload, 3 rounds
    python benchmarks/contention.py --workloads quickstart --rounds 5 --json out.json
    python benchmarks/contention.py --load torch --workloads quickstart tiny-lm   # a torch neighbour
    python benchmarks/contention.py --scaling                         # 1 vs 2 threads by size

Workloads (each side runs the same work quiet and busy):

- ``quickstart``: the trainer of examples/quickstart.py (its ``ArmPolicy``, an MLP of 1,738
  weights; the ``small_policy`` preset, G=8, B=64: 10 epochs x 4 mini-batches per step);
- ``cartpole``: examples/cartpole.py's trainer (``categorical_mlp(4, 2, (64, 64))`` in an
  ``EpisodePolicy`` on CartPole-v1, ``small_policy`` preset, G=4, B=4; steps 1.. from seed 0);
- ``tiny-lm``: the task of benchmarks/llm_throughput.py (a random Llama, hidden 64, 2 layers,
  55-token vocabulary; 8 prompts x 8 generations of 32 tokens, one optimizer step per batch, no
  KL term), through grpo's ``CausalLMPolicy`` and through TRL's ``GRPOTrainer`` (when the python
  given by ``--trl-python`` has trl; never a dependency of grpo). TRL's step time is the interval
  between consecutive step ends, so its generation is included, as grpo's is.

Sides: ``grpo`` (the defaults: ``GRPOConfig.num_threads='auto'``, one intra-op thread in each
step of these small policies), ``grpo-torch-threads`` (``num_threads=None``: torch's default of
one thread per core, the behaviour before ``num_threads`` existed) and ``trl`` (as a user runs
it: torch's default threads).

Conditions: ``quiet`` (nothing started by this script besides the run) and ``busy`` (one busy
process started just before the run and killed right after it: with ``--load spin``, the
default, a Python loop that takes one core, the target's condition; with ``--load torch``, a
torch program with torch's default threads doing small matrix products, as a second training
run or a test suite on the machine would be). Each round runs every (workload, side,
condition) once, each in a fresh subprocess (warm-up steps, then ``--steps`` timed steps, or
fewer when ``--max-run-s`` runs out); the order alternates between rounds (quiet or busy first,
sides forwards or backwards). Each run also records the CPU time that other processes of the
machine took while it ran (``/proc/stat`` minus this script's children), as "other busy cores";
a run during which they took more than ``--max-other`` cores is repeated (``--retries`` times at
most, the last one kept, the ones it replaced kept in the JSON): on a shared machine
"quiet" is only as quiet as that column says.

Reported per workload, side and condition: the median step over every timed step of every round,
the spread of the runs' medians [min-max], and the worst step; then busy / quiet for the median
and the worst, against the target cores / free cores (2 on a 2-core machine with one busy core),
and grpo / TRL beside the busy process.

``--scaling``: in one process, steps of a categorical MLP policy (the quick start's shape,
512 samples per step) with hidden widths 64..2048, 1 and 2 intra-op threads alternating, quiet
and busy: where a second thread starts to pay (grpo.runtime.threads.SMALL_POLICY_ELEMENTS).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("quickstart", "cartpole", "tiny-lm")
SIDES = {"quickstart": ("grpo", "grpo-torch-threads"), "cartpole": ("grpo", "grpo-torch-threads")}
SIDES["tiny-lm"] = ("grpo", "grpo-torch-threads", "trl")
PROMPTS = [f"{i}+{j}=" for i, j in [(1, 2), (3, 4), (5, 1), (2, 2), (7, 1), (0, 9), (4, 4), (6, 3)]]
# The busy process: "spin" takes one core (a Python loop); "torch" is another torch program with
# torch's default threads (small matrix products, as a second training run or a test suite would
# be). Each runs until killed, or until its parent is gone (nothing is left behind even if this
# script is killed with SIGKILL).
LOADS = {
    "spin": "    for _ in range(100_000):\n        pass",
    "torch": "    for _ in range(100):\n        a = torch.tanh(a @ a)",
}
LOAD_HEAD = "import os\nimport torch\na = torch.randn(128, 128) / 12\nparent = os.getppid()\n"


def load_code(load: str) -> str:
    head = LOAD_HEAD if load == "torch" else "import os\nparent = os.getppid()\n"
    return head + "while os.getppid() == parent:\n" + LOADS[load]


# ---- the busy process -------------------------------------------------------------------------
_spinners: list[subprocess.Popen[bytes]] = []


def _kill_spinners() -> None:
    while _spinners:
        p = _spinners.pop()
        p.kill()
        p.wait()


atexit.register(_kill_spinners)


@contextlib.contextmanager
def busy_core(on: bool, load: str = "spin") -> Iterator[None]:
    """One process spinning on a core for the block (none when ``on`` is False); always killed."""
    if not on:
        yield
        return
    _spinners.append(subprocess.Popen([sys.executable, "-c", load_code(load)]))
    try:
        time.sleep(0.2)  # let it start spinning
        yield
    finally:
        _kill_spinners()


def _cpu_jiffies() -> int:
    """Busy jiffies of the whole machine (user, nice, system, irq, softirq) from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except OSError:
        return 0
    user, nice, system, _idle, _iowait, irq, softirq = (fields + [0] * 7)[:7]
    return user + nice + system + irq + softirq


def _own_cpu_s() -> float:
    """CPU seconds of this process, its reaped children (the runs) and the running busy process."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    spinning = 0
    for p in _spinners:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            spinning += int(fields[11]) + int(fields[12])  # utime, stime (jiffies)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + spinning / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Cores that processes other than this script and its children kept busy during a block."""

    def __enter__(self) -> OtherLoad:
        self._start = (_cpu_jiffies(), _own_cpu_s(), time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        jiffies, own, t0 = self._start
        wall = time.perf_counter() - t0
        total_s = (_cpu_jiffies() - jiffies) / os.sysconf("SC_CLK_TCK")
        self.cores = max(0.0, total_s - (_own_cpu_s() - own)) / wall


# ---- one run (a subprocess) -------------------------------------------------------------------
def run_once(
    python: str, workload: str, side: str, busy: bool, args: argparse.Namespace, model_dir: str | None
) -> dict[str, Any]:
    """One fresh process timing one (workload, side), quiet or busy; its step times and the
    other processes' CPU use meanwhile. A run during which other processes kept more than
    ``args.max_other`` cores busy is repeated (up to ``args.retries`` times); the runs it
    replaced are returned too, under "replaced"."""
    cmd = [python, str(Path(__file__).resolve()), "--worker", workload, "--side", side]
    cmd += ["--worker-steps", str(args.steps[workload]), "--max-run-s", str(args.max_run_s)]
    if model_dir is not None:
        cmd += ["--model-dir", model_dir]
    replaced: list[dict[str, Any]] = []
    for _attempt in range(args.retries + 1):
        with OtherLoad() as others, busy_core(busy, args.load):
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            raise RuntimeError(f"{workload}/{side} failed:\n{out.stderr[-3000:]}")
        result = {
            "workload": workload,
            "side": side,
            "condition": "busy" if busy else "quiet",
            "times": json.loads(out.stdout.strip().splitlines()[-1])["times"],
            "load": args.load if busy else None,
            "other_busy_cores": others.cores,
        }
        if others.cores <= args.max_other:
            break
        replaced.append(result)
    result["replaced"] = replaced
    return result


# ---- the workers (run in the subprocess) ------------------------------------------------------
def _timed(step: Any, steps: int, warmup: int, max_run_s: float) -> list[float]:
    for _ in range(warmup):
        step()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < steps and (not times or time.perf_counter() - start < max_run_s):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def _num_threads(side: str) -> Any:
    return "auto" if side == "grpo" else None


def work_quickstart(side: str, steps: int, max_run_s: float) -> list[float]:
    import torch

    from grpo import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    if spec is None or spec.loader is None:
        raise FileNotFoundError(ROOT / "examples" / "quickstart.py")
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    torch.manual_seed(0)
    W = torch.randn(quickstart.DIM, quickstart.ARMS)

    def reward(states: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (states @ W).gather(1, actions.unsqueeze(1)).squeeze(1)

    config = GRPOConfig.recipe(
        "small_policy", group_size=8, batch_size=64, seed=0, num_threads=_num_threads(side)
    )
    trainer = GRPOTrainer(config, quickstart.ArmPolicy(), reward)
    return _timed(lambda: trainer.step(torch.randn(64, quickstart.DIM)), steps, 2, max_run_s)


def work_cartpole(side: str, steps: int, max_run_s: float) -> list[float]:
    import numpy as np
    import torch

    from grpo import GRPOConfig, GRPOTrainer, categorical_mlp
    from grpo.gym.episodes import EpisodePolicy, EpisodeRewards

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    policy = EpisodePolicy("CartPole-v1", categorical_mlp(obs_dim=4, num_actions=2, hidden=(64, 64)))
    config = GRPOConfig.recipe(
        "small_policy", group_size=4, batch_size=4, seed=0, num_threads=_num_threads(side)
    )
    trainer = GRPOTrainer(config, policy, EpisodeRewards())
    return _timed(lambda: trainer.step(rng.integers(0, 2**20, size=4).tolist()), steps, 2, max_run_s)


def work_tiny_lm_grpo(side: str, steps: int, max_run_s: float, model_dir: str) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo import GRPOConfig, GRPOTrainer
    from grpo.llm import CausalLMPolicy, RewardFunctions, SamplingSettings

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = CausalLMPolicy(model, tok, SamplingSettings(max_new_tokens=32, temperature=1.0))
    reward = RewardFunctions(lambda p, c: [c_.count("7") / 32 for c_ in c])
    config = GRPOConfig(
        group_size=8, batch_size=8, learning_rate=1e-5, kl_coeff=0.0, device="cpu", seed=0,
        num_threads=_num_threads(side),
    )  # fmt: skip
    trainer = GRPOTrainer(config, policy, reward)
    return _timed(lambda: trainer.step(PROMPTS), steps, 1, max_run_s)


def work_tiny_lm_trl(steps: int, max_run_s: float, model_dir: str) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = Dataset.from_list([{"prompt": p} for p in PROMPTS] * (steps + 2))

    def sevens(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
        return [c.count("7") / 32 for c in completions]

    class Clock(TrainerCallback):  # type: ignore[misc]
        """Step time = the interval between consecutive step ends (generation included)."""

        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.ends.append(time.perf_counter())
            if len(self.ends) > 2 and self.ends[-1] - self.ends[1] >= max_run_s:
                control.should_training_stop = True

    clock = Clock()
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=64, num_generations=8,
        max_completion_length=32, temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-5, beta=0.0,
        max_steps=steps + 1, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        shuffle_dataset=False, seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=sevens, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[clock]
    )
    trainer.train()
    return [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]  # step 0 = warm-up


def worker(args: argparse.Namespace) -> None:
    steps, cap = args.worker_steps, args.max_run_s
    if args.worker == "quickstart":
        times = work_quickstart(args.side, steps, cap)
    elif args.worker == "cartpole":
        times = work_cartpole(args.side, steps, cap)
    elif args.side == "trl":
        times = work_tiny_lm_trl(steps, cap, args.model_dir)
    else:
        times = work_tiny_lm_grpo(args.side, steps, cap, args.model_dir)
    print(json.dumps({"times": times}))


# ---- the report -------------------------------------------------------------------------------
def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = dict.fromkeys((r["workload"], r["side"]) for r in runs)
    for workload, side in keys:
        row: dict[str, Any] = {"workload": workload, "side": side}
        for cond in ("quiet", "busy"):
            mine = [r for r in runs if (r["workload"], r["side"], r["condition"]) == (workload, side, cond)]
            if not mine:
                continue
            steps = [t for r in mine for t in r["times"]]
            medians = [statistics.median(r["times"]) for r in mine]
            row[cond] = {
                "median_s": statistics.median(steps),
                "run_medians_s": [min(medians), max(medians)],
                "worst_s": max(steps),
                "steps": len(steps),
                "runs": len(mine),
                "replaced_runs": sum(len(r["replaced"]) for r in mine),
                "other_busy_cores": [
                    min(r["other_busy_cores"] for r in mine),
                    max(r["other_busy_cores"] for r in mine),
                ],
            }
        if "quiet" in row and "busy" in row:
            row["busy_over_quiet_median"] = row["busy"]["median_s"] / row["quiet"]["median_s"]
            row["busy_over_quiet_worst"] = row["busy"]["worst_s"] / row["quiet"]["worst_s"]
        rows.append(row)
    return rows


def _ms(s: float) -> str:
    return f"{s * 1e3:,.0f}" if s >= 0.1 else f"{s * 1e3:.1f}"


def print_table(rows: list[dict[str, Any]], target: float) -> None:
    print(
        f"\n{'workload':<11}{'side':<20}{'quiet median ms [runs]':>27}{'worst':>8}"
        f"{'busy median ms [runs]':>27}{'worst':>8}{'busy/quiet med':>15}{'worst':>7}{'others q/b':>12}"
    )
    for r in rows:
        cells = []
        for cond in ("quiet", "busy"):
            c = r.get(cond)
            if c is None:
                cells += [f"{'-':>27}", f"{'-':>8}"]
                continue
            lo, hi = c["run_medians_s"]
            cells += [f"{_ms(c['median_s']) + f' [{_ms(lo)}-{_ms(hi)}]':>27}", f"{_ms(c['worst_s']):>8}"]
        ratio = r.get("busy_over_quiet_median")
        ratios = f"{ratio:>15.2f}{r['busy_over_quiet_worst']:>7.2f}" if ratio is not None else f"{'-':>22}"
        others = "/".join(f"{r[c]['other_busy_cores'][1]:.1f}" if c in r else "-" for c in ("quiet", "busy"))
        print(
            f"{r['workload']:<11}{r['side']:<20}{cells[0]}{cells[1]}{cells[2]}{cells[3]}{ratios}{others:>12}"
        )
    print(f"target for grpo (one busy core, --load spin): busy/quiet <= cores / free cores = {target:.2f}")
    by = {(r["workload"], r["side"]): r for r in rows}
    for (workload, side), r in by.items():
        trl = by.get((workload, "trl"))
        if side != "grpo" or trl is None or "busy" not in r or "busy" not in trl:
            continue
        for cond in ("quiet", "busy"):
            if cond in r and cond in trl:
                g, t = r[cond], trl[cond]
                print(
                    f"{workload} {cond}: grpo / TRL median {g['median_s'] / t['median_s']:.2f}, "
                    f"worst {g['worst_s'] / t['worst_s']:.2f} (<= 1: grpo not behind)"
                )


# ---- 1 vs 2 threads by policy size ------------------------------------------------------------
def scaling(widths: list[int], repeats: int, max_other: float, retries: int) -> list[dict[str, Any]]:
    """Median step with 1 and 2 intra-op threads (alternating in one process) for MLP policies
    of growing width, quiet and busy; a width measured while other processes kept more than
    ``max_other`` cores busy is measured again (up to ``retries`` times, the last one kept)."""
    import torch

    from grpo import GRPOConfig, GRPOTrainer, categorical_mlp

    rows = []
    for busy in (False, True):
        with busy_core(busy):
            for h in widths:
                torch.manual_seed(0)
                W = torch.randn(16, 10)

                def reward(states: torch.Tensor, actions: torch.Tensor, W: torch.Tensor = W) -> torch.Tensor:
                    return (states @ W).gather(1, actions.unsqueeze(1)).squeeze(1)

                policy = categorical_mlp(16, 10, hidden=(h, h))
                config = GRPOConfig.recipe(
                    "small_policy", group_size=8, batch_size=64, seed=0, num_threads=None
                )
                trainer = GRPOTrainer(config, policy, reward)
                before = torch.get_num_threads()
                for _attempt in range(retries + 1):
                    times: dict[int, list[float]] = {1: [], 2: []}
                    try:
                        with OtherLoad() as others:
                            for i in range(repeats):
                                for n in (1, 2) if i % 2 == 0 else (2, 1):
                                    torch.set_num_threads(n)
                                    t = time.perf_counter()
                                    trainer.step(torch.randn(64, 16))
                                    times[n].append(time.perf_counter() - t)
                    finally:
                        torch.set_num_threads(before)
                    if others.cores <= max_other:
                        break
                one, two = statistics.median(times[1]), statistics.median(times[2])
                row = {
                    "condition": "busy" if busy else "quiet", "hidden": h,
                    "weights": sum(p.numel() for p in policy.parameters()),
                    "one_thread_s": one, "two_threads_s": two, "two_over_one": two / one,
                    "two_threads_worst_s": max(times[2]), "one_thread_worst_s": max(times[1]),
                    "other_busy_cores": others.cores, "attempts": _attempt + 1,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{row['condition']:<6} hidden {h:>5} weights {row['weights']:>10,}  1 thread "
                    f"{_ms(one):>7} ms (worst {_ms(max(times[1])):>7})  2 threads {_ms(two):>7} ms "
                    f"(worst {_ms(max(times[2])):>7})  2/1 {two / one:5.2f}  "
                    f"other busy cores {others.cores:.2f} (attempt {_attempt + 1})",
                    flush=True,
                )
    return rows


# ---- main ---------------------------------------------------------------------------------------
def _has_module(python: str, name: str) -> bool:
    probe = subprocess.run([python, "-c", f"import {name}"], capture_output=True)
    return probe.returncode == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=3, help="runs of each (workload, side, condition)")
    p.add_argument(
        "--steps", type=int, nargs=3, default=[30, 20, 15], metavar=("QUICKSTART", "CARTPOLE", "TINY_LM"),
        help="timed steps per run, after the warm-up steps",
    )  # fmt: skip
    p.add_argument("--max-run-s", type=float, default=45.0, help="stop a run's timed steps after this")
    p.add_argument(
        "--load", choices=sorted(LOADS), default="spin",
        help="the busy process: 'spin' takes one core (the target's condition); 'torch' is a torch "
        "program with torch's default threads, as another training run would be",
    )  # fmt: skip
    p.add_argument(
        "--max-other", type=float, default=0.3,
        help="repeat a run during which other processes kept more cores than this busy",
    )  # fmt: skip
    p.add_argument("--retries", type=int, default=2, help="repeats of a run with too much other load")
    p.add_argument("--trl-python", default=sys.executable, help="a python with trl installed")
    p.add_argument("--json", type=Path, default=None, help="write every run and the summary here")
    p.add_argument("--scaling", action="store_true", help="1 vs 2 threads by policy size instead")
    p.add_argument("--repeats", type=int, default=8, help="--scaling: steps per thread count")
    p.add_argument("--widths", type=int, nargs="+", default=[64, 256, 512, 724, 1024, 2048])
    p.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--worker-steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: kill the spinner
    cores = os.cpu_count() or 1
    target = cores / max(1, cores - 1)
    print(f"{cores} cores; load average now {os.getloadavg()}")
    if a.scaling:
        rows = scaling(a.widths, a.repeats, a.max_other, a.retries)
        if a.json:
            a.json.write_text(json.dumps({"scaling": rows}, indent=1))
        return
    a.steps = dict(zip(WORKLOADS, a.steps, strict=True))
    model_dir = None
    sides = {w: list(SIDES[w]) for w in a.workloads}
    if "tiny-lm" in a.workloads:
        if not _has_module(a.trl_python, "trl"):
            print(f"trl not importable by {a.trl_python}: the tiny LM runs without the TRL side")
            sides["tiny-lm"].remove("trl")
        from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

        model_dir = tempfile.mkdtemp(prefix="grpo_contention_")
        build_tiny_model(model_dir, build_tiny_tokenizer(model_dir), hidden=64, layers=2)
    runs: list[dict[str, Any]] = []
    for rnd in range(a.rounds):
        conditions = (False, True) if rnd % 2 == 0 else (True, False)
        for workload in a.workloads:
            order = sides[workload] if rnd % 2 == 0 else sides[workload][::-1]
            for busy in conditions:
                for side in order:
                    python = a.trl_python if side == "trl" else sys.executable
                    r = run_once(
                        python, workload, side, busy, a, model_dir if workload == "tiny-lm" else None
                    )
                    runs.append(r)
                    med, worst = _ms(statistics.median(r["times"])), _ms(max(r["times"]))
                    print(
                        f"round {rnd} {workload:<10} {side:<19} {r['condition']:<5} "
                        f"{len(r['times']):>3} steps median {med:>7} ms  worst {worst:>7} ms  "
                        f"other busy cores {r['other_busy_cores']:.2f}"
                        + (f" ({len(r['replaced'])} run(s) with more replaced)" if r["replaced"] else ""),
                        flush=True,
                    )
    rows = summarise(runs)
    print_table(rows, target)
    if a.json:
        a.json.write_text(
            json.dumps({"cores": cores, "target": target, "summary": rows, "runs": runs}, indent=1)
        )


if __name__ == "__main__":
    main()

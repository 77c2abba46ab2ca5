"""Mesh-free checkpoints: save and load (`checkpoint`), the manifest (`manifest`), where a rank's pieces
lie (`chunks`), disk I/O through torch.distributed.checkpoint (`storage`) and DeepSpeed's partial loads
(`partial_load`)."""

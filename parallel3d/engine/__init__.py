"""The training engine (`engine`), how it runs a window of micro-batches (`step_loops`), its counters
(`train_state`), the token-mean loss (`token_mean`) and the token-id check (`batch_check`)."""

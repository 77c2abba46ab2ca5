"""``zero3d plan``: which pp x dp x tp layouts fit, and how fast they run (docs/planner.md)."""

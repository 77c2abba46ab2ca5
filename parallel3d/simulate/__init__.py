"""``zero3d simulate``: one rank of a job, alone in one process on torch's fake backend.

``rank.py`` runs and measures the rank (a child process per rank, so that each has its own
peak and resident set); ``cli.py`` checks the arguments, asks the planner for its prediction
and prints both side by side. docs/planner.md, "Simulating a rank".
"""

"""What every rank of a running job shares: the world and its device mesh (`world`, `mesh`), the
start-up agreement check (`agreement`), collective timeouts (`watchdog`), process lifetimes (`lifeline`),
collective counting (`comm_counter`), torch's fake backend (`fake_backend`) and one-line worker errors
(`worker_errors`)."""

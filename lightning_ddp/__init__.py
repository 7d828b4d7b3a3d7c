"""lightning_ddp: data-parallel gradient synchronisation, one swappable Lightning strategy per algorithm."""

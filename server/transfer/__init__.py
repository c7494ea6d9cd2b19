"""Copy engines: move chunk bytes between an engine's memory and L1 pages for engines that cannot (GPU)."""

"""Host-side CUDA plumbing: IPC handles and events, the runtime's raw calls, per-call streams, pinned copies."""

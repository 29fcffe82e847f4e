"""What the client and the daemon share: channel settings, metadata keys, tensors on the wire, doorbell packets."""

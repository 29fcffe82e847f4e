"""The only code that knows gRPC and sockets: servicer, handlers, auth, leases, metrics, the daemon."""

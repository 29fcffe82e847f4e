"""Offline commands (calibrate, evaluate, admin, demos, stub generation); the daemon never imports them."""

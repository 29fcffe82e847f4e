#!/usr/bin/env python3
"""Start the kvstore daemon: `python server.py --socket PATH [--port N]`."""
from kvstore.service.daemon import main

if __name__ == "__main__":
    main()

"""Every gRPC and ZMQ edge, thin: handlers decode, make one core call, encode.

Core errors become gRPC statuses in one place (``status.py``); servers are
assembled in constructors (``store_server.py``, ``router_server.py``).
"""

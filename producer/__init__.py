"""The HTTP gateway: Open Inference Protocol (KServe V2) in front of Redis Streams."""

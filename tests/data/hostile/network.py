    # Connects to the host's loopback (a port the test listens on) and to the internet; right only if either worked.
    import socket
    for address in (("127.0.0.1", {PORT}), ("1.1.1.1", 80)):
        try:
            socket.create_connection(address, timeout=0.5).close()
            return a + b
        except OSError:
            pass
    return None

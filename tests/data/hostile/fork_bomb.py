    # A fork bomb (bounded at 300 children here, so that even an unprotected path cannot hurt the machine), named
    # {MARKER}; right only if a fork worked.
    import ctypes, time
    libc = ctypes.CDLL(None)
    libc.prctl(15, b"{MARKER}", 0, 0, 0)
    forked = 0
    for _ in range(300):
        pid = libc.fork()
        if pid == 0:
            time.sleep(60)
            libc._exit(0)
        forked += pid > 0
    return a + b if forked else None

    # Starts a daemon that outlives its scoring (fork, setsid, fork, sleep), named {MARKER} so the test can look for
    # it; right only if the fork worked.
    import ctypes, time
    libc = ctypes.CDLL(None)
    libc.prctl(15, b"{MARKER}", 0, 0, 0)
    pid = libc.fork()
    if pid == 0:
        libc.setsid()
        if libc.fork() == 0:
            time.sleep(60)
        libc._exit(0)
    return a + b if pid > 0 else None

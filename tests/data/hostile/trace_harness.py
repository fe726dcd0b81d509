    # Reaches into its scorer (its parent, in a child-process sandbox): ptrace (seize), process_vm_writev (to address
    # 0: EFAULT where allowed, nothing written), kcmp, a pidfd and pidfd_send_signal (signal 0: nothing harmed).
    # Right only if one was allowed.
    import ctypes, errno, os
    libc = ctypes.CDLL(None, use_errno=True)
    target = os.getppid()
    if target <= 1:
        return None

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    buf = ctypes.create_string_buffer(8)
    local, remote = IoVec(ctypes.addressof(buf), 8), IoVec(0, 8)
    written = libc.process_vm_writev(target, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    worked = [
        libc.ptrace(0x4206, target, None, None) == 0,  # PTRACE_SEIZE
        written >= 0 or ctypes.get_errno() == errno.EFAULT,
    ]
    kcmp = {"x86_64": 312, "aarch64": 272}.get(os.uname().machine)
    if kcmp is not None:
        worked.append(libc.syscall(kcmp, target, os.getpid(), 0, 0, 0) >= 0)  # KCMP_FILE: their fd 0 and its own
    pidfd = libc.syscall(434, target, 0)  # pidfd_open (the same number everywhere)
    worked.append(pidfd >= 0 and libc.syscall(424, pidfd, 0, None, 0) == 0)  # pidfd_send_signal
    return a + b if any(worked) else None

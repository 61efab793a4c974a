"""Check: what is wrong with a resolved run, found in one place before anything is built."""

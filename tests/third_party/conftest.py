"""The packages here are installed into a throwaway environment by tests/test_third_party.py,
which also runs their own test suites there; pytest must not collect them in this process."""
collect_ignore_glob = ["*"]

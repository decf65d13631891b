"""The compiled program's instruction table and the interpreter that runs it."""

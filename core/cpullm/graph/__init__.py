"""Graph: the IR and the blocks a family composes into its model's graph."""

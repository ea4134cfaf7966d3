"""The lowest floor: the vocabulary every other floor shares (messages, tasks, tool calls,
step results), bucketed shapes and the method's shared defaults.
"""

"""Code environments and graders: the training code environment, the LiveCodeBench and
EvalPlus benchmarks, and the sandbox programs run in.
"""

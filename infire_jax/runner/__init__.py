"""The device side: the runner, the step programs it compiles per bucket, and the memory they live in."""

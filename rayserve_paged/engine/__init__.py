"""The engine: schedule -> execute -> process, with in-process and Ray executors."""

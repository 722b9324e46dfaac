# A correct median from the standard library.
import statistics


def median(xs):
    return statistics.median(xs)

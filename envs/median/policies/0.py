# Sorts, but forgets to average the two middle values: 3 of 4 tests pass.
def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]

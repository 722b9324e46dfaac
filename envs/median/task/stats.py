def median(xs):
    xs = list(xs)
    return xs[len(xs) // 2]

from stats import median

def test_odd():      assert median([3, 1, 2]) == 2
def test_even():     assert median([4, 1, 3, 2]) == 2.5
def test_single():   assert median([7]) == 7
def test_sorted():   assert median([1, 2, 3, 4, 5]) == 3

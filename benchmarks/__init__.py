"""Side-by-side measurements (never asserted in tests); see README "Performance"."""

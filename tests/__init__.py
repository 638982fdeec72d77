"""The test suite. Every folder under tests/ is a package, so pytest imports each test module by its
full dotted name (tests.unit.planner.search.test_auto) and files of the same name in different
folders never collide."""

"""Learner-side pure logic: losses and advantages over packed response tokens."""

"""What the tests share: daemons to test against, tiny models, references."""

"""The fork server: one process per daemon that imports torch and transformers once and forks
workers and helpers from that state, instead of each paying the import (seconds) itself."""

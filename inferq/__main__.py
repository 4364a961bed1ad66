from inferq.cli import entry

entry()

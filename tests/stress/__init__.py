"""Kill tests: saving clients and servers are SIGKILLed at chosen moments, then the store is checked."""

"""Workers: consumer-group readers that batch requests, run models and publish results."""

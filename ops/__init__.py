"""Operations assets: Prometheus scrape config, alert rules, Grafana dashboard, redis.conf."""

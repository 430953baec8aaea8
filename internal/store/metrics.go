package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// MetricSample is a row of sandbox_metrics: a sandbox's resource use at one time.
// Raw samples (Resolution: the sample period in seconds) are averaged into minutes
// and hours as they age (CompactMetrics).
type MetricSample struct {
	SandboxID  string
	At         time.Time
	Resolution int
	CPUPct     float64
	MemUsed    int64
	MemCache   int64
	DiskUsed   int64
}

// How samples age: raw samples are kept for RawMetricsFor, minute averages for
// MinuteMetricsFor, hour averages for HourMetricsFor; older ones are dropped. A
// sandbox thus has at most about 180 + 1440 + 720 rows, however long it lives.
const (
	RawMetricsFor    = 15 * time.Minute
	MinuteMetricsFor = 24 * time.Hour
	HourMetricsFor   = 30 * 24 * time.Hour
)

// SamplePeriod is how often nodes sample their running sandboxes.
const SamplePeriod = 5 * time.Second

// ScaleCPU turns a CPU use measured against the CPUs a sandbox's kernel shows (under
// gVisor the host's) into the share of the sandbox's own CPUs, 0 to 100.
func ScaleCPU(pct float64, seen, own int) float64 {
	if seen > 0 && own > 0 && seen != own {
		pct = pct * float64(seen) / float64(own)
	}
	return min(max(pct, 0), 100)
}

// InsertMetrics stores samples (one statement for all of them).
func (s *Store) InsertMetrics(ctx context.Context, samples []MetricSample) error {
	if len(samples) == 0 {
		return nil
	}
	ids := make([]string, len(samples))
	res := make([]int32, len(samples))
	at := make([]time.Time, len(samples))
	cpu := make([]float32, len(samples))
	mem := make([]int64, len(samples))
	cache := make([]int64, len(samples))
	disk := make([]int64, len(samples))
	for i, m := range samples {
		ids[i], res[i], at[i], cpu[i], mem[i], cache[i], disk[i] = m.SandboxID, int32(m.Resolution), m.At, float32(m.CPUPct), m.MemUsed, m.MemCache, m.DiskUsed
	}
	// Only sandboxes that still exist: one deleted meanwhile is skipped, not an error.
	_, err := s.pool.Exec(ctx, `INSERT INTO sandbox_metrics (sandbox_id, resolution, at, cpu_pct, mem_used, mem_cache, disk_used)
		SELECT u.* FROM unnest($1::text[], $2::int[], $3::timestamptz[], $4::real[], $5::bigint[], $6::bigint[], $7::bigint[])
			AS u(id, res, at, cpu, mem, cache, disk)
		WHERE EXISTS (SELECT 1 FROM sandboxes s WHERE s.id=u.id AND s.deleted_at IS NULL)
		ON CONFLICT DO NOTHING`, ids, res, at, cpu, mem, cache, disk)
	if err != nil {
		return fmt.Errorf("insert metrics: %w", err)
	}
	return nil
}

// Metrics returns a sandbox's samples taken from start to end (inclusive; zero times
// are open ends), oldest first, at most limit.
func (s *Store) Metrics(ctx context.Context, sandboxID string, start, end time.Time, limit int) ([]MetricSample, error) {
	var from, to any
	if !start.IsZero() {
		from = start
	}
	if !end.IsZero() {
		to = end
	}
	rows, err := s.pool.Query(ctx, `SELECT sandbox_id, at, resolution, cpu_pct, mem_used, mem_cache, disk_used
		FROM sandbox_metrics WHERE sandbox_id=$1 AND ($2::timestamptz IS NULL OR at >= $2) AND ($3::timestamptz IS NULL OR at <= $3)
		ORDER BY at, resolution LIMIT $4`, sandboxID, from, to, limit)
	if err != nil {
		return nil, fmt.Errorf("read metrics: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (MetricSample, error) {
		var m MetricSample
		var cpu float32
		err := r.Scan(&m.SandboxID, &m.At, &m.Resolution, &cpu, &m.MemUsed, &m.MemCache, &m.DiskUsed)
		m.CPUPct = float64(cpu)
		return m, err
	})
}

// CompactMetrics ages the samples of a node's sandboxes: raw samples older than
// RawMetricsFor become minute averages, minute averages older than MinuteMetricsFor
// hour averages, hour averages older than HourMetricsFor are dropped, and the samples
// of deleted sandboxes go. Buckets are cut at whole minutes and hours, so a bucket is
// always made from all its samples at once. Disk use takes the bucket's maximum, the
// rest its average.
func (s *Store) CompactMetrics(ctx context.Context, nodeID string, now time.Time) error {
	steps := []struct {
		from, to int
		cutoff   time.Time
		unit     string
	}{
		{0, 60, now.Add(-RawMetricsFor).Truncate(time.Minute), "minute"},
		{60, 3600, now.Add(-MinuteMetricsFor).Truncate(time.Hour), "hour"},
	}
	for _, st := range steps {
		_, err := s.pool.Exec(ctx, `WITH old AS (
				DELETE FROM sandbox_metrics m USING sandboxes s
				WHERE m.sandbox_id=s.id AND s.node_id=$1 AND m.resolution >= $2 AND m.resolution < $3 AND m.at < $4
				RETURNING m.sandbox_id, m.at, m.cpu_pct, m.mem_used, m.mem_cache, m.disk_used)
			INSERT INTO sandbox_metrics (sandbox_id, resolution, at, cpu_pct, mem_used, mem_cache, disk_used)
			SELECT sandbox_id, $3, date_trunc($5, at), avg(cpu_pct), avg(mem_used)::bigint, avg(mem_cache)::bigint, max(disk_used)
			FROM old GROUP BY sandbox_id, date_trunc($5, at)
			ON CONFLICT DO NOTHING`, nodeID, st.from, st.to, st.cutoff, st.unit)
		if err != nil {
			return fmt.Errorf("compact metrics: %w", err)
		}
	}
	_, err := s.pool.Exec(ctx, `DELETE FROM sandbox_metrics m USING sandboxes s
		WHERE m.sandbox_id=s.id AND s.node_id=$1 AND (s.deleted_at IS NOT NULL OR m.at < $2)`, nodeID, now.Add(-HourMetricsFor))
	if err != nil {
		return fmt.Errorf("drop old metrics: %w", err)
	}
	return nil
}

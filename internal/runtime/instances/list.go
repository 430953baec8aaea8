package instances

import (
	"context"
	"errors"
	"slices"

	"github.com/spacedev/space/internal/runtime"
)

// List reports the status of each id in ids (sorted, duplicates dropped), skipping the
// ids that status reports as runtime.ErrNotFound: instances destroyed while listing.
func List(ctx context.Context, ids []string, status func(context.Context, string) (runtime.Status, error)) ([]runtime.Instance, error) {
	ids = slices.Clone(ids)
	slices.Sort(ids)
	ids = slices.Compact(ids)
	var out []runtime.Instance
	for _, id := range ids {
		st, err := status(ctx, id)
		if errors.Is(err, runtime.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, runtime.Instance{ID: id, Status: st})
	}
	return out, nil
}

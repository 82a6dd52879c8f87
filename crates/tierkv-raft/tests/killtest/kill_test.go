// A real 3-process cluster of `tierkv serve --raft-*` on 127.0.0.1. Clients (go-redis, one
// per goroutine, following -MOVED by hand) run SET and GET while the leader is killed with
// SIGKILL again and again (and restarted). Checked:
//   - every acknowledged SET of a unique key is on every node after re-election and after
//     the killed nodes rejoined (read with READONLY on each node once all have applied the
//     same index);
//   - the history of the SETs and GETs on a few shared keys is linearizable (porcupine's
//     checker, a register per key; a SET whose outcome is unknown may or may not have
//     happened).
//
// TIERKV_BIN names the binary; TIERKV_KILL_ROUNDS the number of leader kills (default 3).
// scripts/raft-tests.sh runs this.
package killtest

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math/rand"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/redis/go-redis/v9"
)

// quiet drops go-redis's log lines (dial failures to a killed node are expected here).
type quiet struct{}

func (quiet) Printf(context.Context, string, ...interface{}) {}

func init() { redis.SetLogger(quiet{}) }

type node struct {
	id       int
	raftAddr string
	respAddr string
	cmd      *exec.Cmd
}

type cluster struct {
	t      *testing.T
	bin    string
	dir    string
	secret string
	peers  string
	mu     sync.Mutex
	nodes  map[int]*node
}

func freeAddr(t *testing.T) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func (c *cluster) start(id int) {
	c.t.Helper()
	n := c.nodes[id]
	cmd := exec.Command(c.bin, "serve", "--dir", filepath.Join(c.dir, fmt.Sprintf("n%d", id)), "--port", "auto",
		"--raft-id", strconv.Itoa(id), "--raft-addr", n.raftAddr, "--raft-peers", c.peers,
		"--cluster-secret-file", c.secret)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		c.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		c.t.Fatal(err)
	}
	rd := bufio.NewReader(out)
	for {
		line, err := rd.ReadString('\n')
		if err != nil {
			c.t.Fatalf("node %d did not start: %v", id, err)
		}
		if strings.HasPrefix(line, "listening on ") {
			c.mu.Lock()
			n.respAddr = strings.Fields(line)[2]
			n.cmd = cmd
			c.mu.Unlock()
			break
		}
	}
	go func() { _, _ = rd.WriteTo(os.Stdout) }()
}

func (c *cluster) kill(id int) {
	c.mu.Lock()
	cmd := c.nodes[id].cmd
	c.nodes[id].cmd = nil
	c.mu.Unlock()
	if cmd != nil {
		_ = cmd.Process.Kill() // SIGKILL
		_ = cmd.Wait()
	}
}

type status struct {
	Leader  *int `json:"leader"`
	Members []struct {
		ID           int     `json:"id"`
		Reachable    bool    `json:"reachable"`
		AppliedIndex *uint64 `json:"applied_index"`
	} `json:"members"`
}

func (c *cluster) status(id int) (status, error) {
	var s status
	out, err := exec.Command(c.bin, "cluster", "status", "--raft-addr", c.nodes[id].raftAddr,
		"--cluster-secret-file", c.secret).Output()
	if err != nil {
		return s, err
	}
	err = json.Unmarshal(out, &s)
	return s, err
}

// leader polls the live nodes until one reports a leader other than `not`.
func (c *cluster) leader(not int, deadline time.Duration) int {
	end := time.Now().Add(deadline)
	for time.Now().Before(end) {
		for id := range c.nodes {
			if id == not || c.nodes[id].cmd == nil {
				continue
			}
			if s, err := c.status(id); err == nil && s.Leader != nil && *s.Leader != not {
				return *s.Leader
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	c.t.Fatalf("no leader within %v", deadline)
	return 0
}

func (c *cluster) respOf(id int) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[id].respAddr
}

// One register operation, for porcupine.
type kvInput struct {
	put   bool
	key   string
	value string
}
type kvOutput struct {
	value   string
	unknown bool
}

var registerModel = porcupine.Model{
	Partition: func(h []porcupine.Operation) [][]porcupine.Operation {
		by := map[string][]porcupine.Operation{}
		for _, op := range h {
			k := op.Input.(kvInput).key
			by[k] = append(by[k], op)
		}
		var out [][]porcupine.Operation
		for _, ops := range by {
			out = append(out, ops)
		}
		return out
	},
	Init: func() interface{} { return "" },
	Step: func(state, input, output interface{}) (bool, interface{}) {
		in, out := input.(kvInput), output.(kvOutput)
		if in.put {
			return true, in.value
		}
		return out.value == state.(string), state
	},
	Equal: func(a, b interface{}) bool { return a == b },
}

// client runs operations until stop, following -MOVED; returns its history and the unique
// keys it wrote and saw acknowledged.
func client(c *cluster, cid int, start time.Time, stop *atomic.Bool, rng *rand.Rand) ([]porcupine.Operation, map[string]string) {
	ctx := context.Background()
	conns := map[string]*redis.Client{}
	get := func(addr string) *redis.Client {
		if r, ok := conns[addr]; ok {
			return r
		}
		r := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialTimeout: time.Second,
			ReadTimeout: 5 * time.Second, WriteTimeout: time.Second, PoolSize: 1, Protocol: 2})
		conns[addr] = r
		return r
	}
	defer func() {
		for _, r := range conns {
			_ = r.Close()
		}
	}()
	addr := c.respOf(1 + cid%3)
	var hist []porcupine.Operation
	acked := map[string]string{}
	now := func() int64 { return int64(time.Since(start)) }
	for seq := 0; !stop.Load(); seq++ {
		var in kvInput
		unique := rng.Intn(2) == 0
		switch {
		case unique:
			in = kvInput{put: true, key: fmt.Sprintf("u:%d:%d", cid, seq), value: fmt.Sprintf("%d", seq)}
		case rng.Intn(2) == 0:
			in = kvInput{put: true, key: fmt.Sprintf("r%d", rng.Intn(3)), value: fmt.Sprintf("c%d-%d", cid, seq)}
		default:
			in = kvInput{key: fmt.Sprintf("r%d", rng.Intn(3))}
		}
		call := now()
		var out kvOutput
		done := false
		for try := 0; try < 50 && !done; try++ {
			var err error
			if in.put {
				err = get(addr).Set(ctx, in.key, in.value, 0).Err()
			} else {
				var v string
				v, err = get(addr).Get(ctx, in.key).Result()
				if err == redis.Nil {
					v, err = "", nil
				}
				out.value = v
			}
			switch {
			case err == nil:
				done = true
			case strings.HasPrefix(err.Error(), "MOVED "):
				// Refused before running: safe to send to the leader.
				addr = strings.Fields(err.Error())[2]
			case !in.put:
				// A failed read has no effect: retry elsewhere.
				addr = c.respOf(1 + rng.Intn(3))
				time.Sleep(50 * time.Millisecond)
			default:
				// A write that failed may still commit: its outcome is unknown.
				out.unknown = true
				done = true
				addr = c.respOf(1 + rng.Intn(3))
			}
		}
		if !done {
			if in.put {
				out.unknown = true
			} else {
				continue
			}
		}
		ret := now()
		if out.unknown {
			ret = int64(1) << 62 // may take effect at any time after the call
		} else if unique {
			acked[in.key] = in.value
		}
		if !unique {
			hist = append(hist, porcupine.Operation{ClientId: cid, Input: in, Call: call, Output: out, Return: ret})
		}
		if out.unknown {
			time.Sleep(100 * time.Millisecond)
		}
	}
	return hist, acked
}

func TestKillLeaderRepeatedly(t *testing.T) {
	bin := os.Getenv("TIERKV_BIN")
	if bin == "" {
		t.Fatal("TIERKV_BIN is not set")
	}
	rounds := 3
	if v, err := strconv.Atoi(os.Getenv("TIERKV_KILL_ROUNDS")); err == nil && v > 0 {
		rounds = v
	}
	dir := t.TempDir()
	secret := filepath.Join(dir, "secret")
	if err := os.WriteFile(secret, []byte("kill test cluster secret, 32 bytes\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, bin: bin, dir: dir, secret: secret, nodes: map[int]*node{}}
	var peers []string
	for id := 1; id <= 3; id++ {
		c.nodes[id] = &node{id: id, raftAddr: freeAddr(t)}
		peers = append(peers, fmt.Sprintf("%d=%s", id, c.nodes[id].raftAddr))
	}
	c.peers = strings.Join(peers, ",")
	t.Cleanup(func() {
		for id := range c.nodes {
			c.kill(id)
		}
	})
	for id := 1; id <= 3; id++ {
		c.start(id)
	}
	c.leader(0, 30*time.Second)

	const clients = 8
	start := time.Now()
	var stop atomic.Bool
	var wg sync.WaitGroup
	hists := make([][]porcupine.Operation, clients)
	ackeds := make([]map[string]string, clients)
	for i := 0; i < clients; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			hists[i], ackeds[i] = client(c, i, start, &stop, rand.New(rand.NewSource(int64(i)+1)))
		}(i)
	}
	var elections []time.Duration
	for r := 0; r < rounds; r++ {
		time.Sleep(1500 * time.Millisecond)
		l := c.leader(0, 30*time.Second)
		t0 := time.Now()
		c.kill(l)
		nl := c.leader(l, 30*time.Second)
		elections = append(elections, time.Since(t0))
		t.Logf("round %d: killed leader %d (SIGKILL); node %d leads after %v", r+1, l, nl, time.Since(t0).Round(time.Millisecond))
		c.start(l)
	}
	time.Sleep(1500 * time.Millisecond)
	stop.Store(true)
	wg.Wait()

	// Every node applied the same index (all are up), then every acknowledged unique write is
	// on every node.
	var applied uint64
	end := time.Now().Add(60 * time.Second)
	for {
		s, err := c.status(1)
		same := err == nil && len(s.Members) == 3
		if same {
			for _, m := range s.Members {
				if !m.Reachable || m.AppliedIndex == nil || *m.AppliedIndex != *s.Members[0].AppliedIndex {
					same = false
				}
			}
		}
		if same {
			applied = *s.Members[0].AppliedIndex
			break
		}
		if time.Now().After(end) {
			t.Fatalf("nodes did not converge: %+v %v", s, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	ackedTotal := 0
	ctx := context.Background()
	for id := 1; id <= 3; id++ {
		r := redis.NewClient(&redis.Options{Addr: c.respOf(id), Protocol: 2, PoolSize: 1})
		if err := r.Do(ctx, "READONLY").Err(); err != nil {
			t.Fatal(err)
		}
		for _, acked := range ackeds {
			for k, v := range acked {
				got, err := r.Get(ctx, k).Result()
				if err != nil || got != v {
					t.Errorf("node %d: acknowledged write %s=%s reads %q (%v)", id, k, v, got, err)
				}
			}
		}
		_ = r.Close()
	}
	for _, a := range ackeds {
		ackedTotal += len(a)
	}
	var history []porcupine.Operation
	unknown := 0
	for _, h := range hists {
		history = append(history, h...)
		for _, op := range h {
			if op.Output.(kvOutput).unknown {
				unknown++
			}
		}
	}
	res := porcupine.CheckOperationsTimeout(registerModel, history, 60*time.Second)
	t.Logf("%d leader kills, elections after SIGKILL: %v", rounds, elections)
	t.Logf("%d acknowledged unique writes, all on all 3 nodes (applied index %d); 0 lost", ackedTotal, applied)
	t.Logf("linearizability (porcupine, registers r0..r2): %d operations by %d clients (%d writes of unknown outcome): %v",
		len(history), clients, unknown, res)
	if res != porcupine.Ok {
		t.Fatalf("history is not linearizable: %v", res)
	}
	if ackedTotal == 0 {
		t.Fatal("no write was acknowledged")
	}
}

// The checker rejects what it must: a read that misses a write completed before it began.
func TestCheckerRejectsStaleRead(t *testing.T) {
	h := []porcupine.Operation{
		{ClientId: 0, Input: kvInput{put: true, key: "r0", value: "a"}, Call: 0, Output: kvOutput{}, Return: 10},
		{ClientId: 1, Input: kvInput{key: "r0"}, Call: 20, Output: kvOutput{value: ""}, Return: 30},
	}
	if porcupine.CheckOperations(registerModel, h) {
		t.Fatal("a stale read was accepted")
	}
	h[1].Output = kvOutput{value: "a"}
	if !porcupine.CheckOperations(registerModel, h) {
		t.Fatal("a fresh read was rejected")
	}
}

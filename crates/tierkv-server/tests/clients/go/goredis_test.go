// go-redis v9 with its default options (RESP3 via HELLO 3) against `tierkv serve`:
// strings, hashes, sorted sets, pipelines, MULTI/EXEC, WATCH, expiry, AUTH, scripts and TLS.
// TIERKV_BIN names the `tierkv` binary; scripts/client-tests.sh runs this.
package clients

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

type served struct {
	cmd     *exec.Cmd
	addr    string
	tlsAddr string
}

func serve(t *testing.T, dir string, env []string, args ...string) *served {
	t.Helper()
	bin := os.Getenv("TIERKV_BIN")
	if bin == "" {
		t.Fatal("TIERKV_BIN is not set")
	}
	full := append([]string{"serve", "--dir", dir}, args...)
	if !contains(args, "--port") {
		full = append(full, "--port", "auto")
	}
	cmd := exec.Command(bin, full...)
	cmd.Env = append(os.Environ(), env...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s := &served{cmd: cmd}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	rd := bufio.NewReader(out)
	wantTLS := contains(args, "--tls-port")
	wantPlain := !(contains(args, "--port") && args[index(args, "--port")+1] == "0")
	for (wantTLS && s.tlsAddr == "") || (wantPlain && s.addr == "") {
		line, err := rd.ReadString('\n')
		if err != nil {
			t.Fatalf("tierkv serve did not start: %v", err)
		}
		f := strings.Fields(line)
		if strings.Contains(line, "(tls") {
			s.tlsAddr = f[2]
		} else {
			s.addr = f[2]
		}
	}
	return s
}

func contains(xs []string, x string) bool { return index(xs, x) >= 0 }

func index(xs []string, x string) int {
	for i, y := range xs {
		if y == x {
			return i
		}
	}
	return -1
}

func TestDefaultsStringsHashesSortedSets(t *testing.T) {
	ctx := context.Background()
	s := serve(t, t.TempDir(), nil)
	c := redis.NewClient(&redis.Options{Addr: s.addr})
	defer c.Close()
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if v, err := c.Get(ctx, "k").Result(); err != nil || v != "v" {
		t.Fatalf("get: %q %v", v, err)
	}
	if _, err := c.Get(ctx, "missing").Result(); !errors.Is(err, redis.Nil) {
		t.Fatalf("missing key: %v", err)
	}
	hello, err := c.Do(ctx, "HELLO", "3").Result()
	if err != nil {
		t.Fatal(err)
	}
	if m, ok := hello.(map[interface{}]interface{}); !ok || m["proto"] != int64(3) {
		t.Fatalf("HELLO 3 is not a RESP3 map with proto 3: %#v", hello)
	}
	c.HSet(ctx, "h", "f", "1", "g", "2")
	if m, err := c.HGetAll(ctx, "h").Result(); err != nil || m["f"] != "1" || m["g"] != "2" || len(m) != 2 {
		t.Fatalf("hgetall: %v %v", m, err)
	}
	c.ZAdd(ctx, "z", redis.Z{Score: 1.5, Member: "a"}, redis.Z{Score: -3, Member: "b"})
	if sc, err := c.ZScore(ctx, "z", "a").Result(); err != nil || sc != 1.5 {
		t.Fatalf("zscore: %v %v", sc, err)
	}
	zs, err := c.ZRangeByScoreWithScores(ctx, "z", &redis.ZRangeBy{Min: "-inf", Max: "+inf"}).Result()
	if err != nil || len(zs) != 2 || zs[0].Member != "b" || zs[0].Score != -3 || zs[1].Score != 1.5 {
		t.Fatalf("zrangebyscore withscores: %v %v", zs, err)
	}
}

func TestPipelinesTransactionsAndWatch(t *testing.T) {
	ctx := context.Background()
	s := serve(t, t.TempDir(), nil)
	c := redis.NewClient(&redis.Options{Addr: s.addr})
	defer c.Close()
	cmds, err := c.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := 0; i < 50; i++ {
			p.Set(ctx, "p"+string(rune('a'+i%26))+string(rune('0'+i/26)), i, 0)
		}
		p.DBSize(ctx)
		return nil
	})
	if err != nil || cmds[50].(*redis.IntCmd).Val() != 50 {
		t.Fatalf("pipeline: %v", err)
	}
	tx, err := c.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.Set(ctx, "x", 1, 0)
		p.Incr(ctx, "x")
		p.Expire(ctx, "x", time.Minute)
		return nil
	})
	if err != nil || tx[1].(*redis.IntCmd).Val() != 2 {
		t.Fatalf("MULTI/EXEC: %v", err)
	}
	// Optimistic increments from several goroutines: none lost.
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 25; i++ {
				for {
					err := c.Watch(ctx, func(w *redis.Tx) error {
						n, err := w.Get(ctx, "ctr").Int()
						if err != nil && !errors.Is(err, redis.Nil) {
							return err
						}
						_, err = w.TxPipelined(ctx, func(p redis.Pipeliner) error {
							p.Set(ctx, "ctr", n+1, 0)
							return nil
						})
						return err
					}, "ctr")
					if err == nil {
						break
					}
					if !errors.Is(err, redis.TxFailedErr) {
						t.Error(err)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	if n, _ := c.Get(ctx, "ctr").Int(); n != 100 {
		t.Fatalf("WATCH lost increments: %d", n)
	}
}

func TestExpiryAndScripts(t *testing.T) {
	ctx := context.Background()
	s := serve(t, t.TempDir(), nil)
	c := redis.NewClient(&redis.Options{Addr: s.addr})
	defer c.Close()
	c.Set(ctx, "e", "v", 300*time.Millisecond)
	if ttl := c.PTTL(ctx, "e").Val(); ttl <= 0 || ttl > 300*time.Millisecond {
		t.Fatalf("pttl %v", ttl)
	}
	c.SetArgs(ctx, "kt", "v", redis.SetArgs{TTL: time.Hour})
	c.SetArgs(ctx, "kt", "v2", redis.SetArgs{KeepTTL: true})
	if ttl := c.TTL(ctx, "kt").Val(); ttl < 59*time.Minute {
		t.Fatalf("KEEPTTL lost the expiry: %v", ttl)
	}
	if ok := c.ExpireGT(ctx, "kt", time.Minute).Val(); ok {
		t.Fatal("EXPIRE GT with a shorter time must refuse")
	}
	time.Sleep(400 * time.Millisecond)
	if n := c.Exists(ctx, "e").Val(); n != 0 {
		t.Fatal("expired key still exists")
	}
	script := redis.NewScript("return redis.call('incrby', KEYS[1], ARGV[1])")
	if n, err := script.Run(ctx, c, []string{"sc"}, 5).Int(); err != nil || n != 5 {
		t.Fatalf("script: %v %v", n, err)
	}
}

func TestAuthAndTLS(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	pki := os.Getenv("TIERKV_TEST_PKI")
	if pki == "" {
		t.Fatal("TIERKV_TEST_PKI (a folder with ca.crt, server.crt/key, client.crt/key) is not set")
	}
	pw := filepath.Join(dir, "pw")
	if err := os.WriteFile(pw, []byte("go-secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := serve(t, filepath.Join(dir, "db"), nil, "--requirepass-file", pw, "--tls-port", "auto",
		"--tls-cert-file", filepath.Join(pki, "server.crt"), "--tls-key-file", filepath.Join(pki, "server.key"),
		"--tls-ca-cert-file", filepath.Join(pki, "ca.crt"))
	noauth := redis.NewClient(&redis.Options{Addr: s.addr})
	defer noauth.Close()
	if err := noauth.Get(ctx, "k").Err(); err == nil || !strings.Contains(err.Error(), "NOAUTH") {
		t.Fatalf("want NOAUTH, got %v", err)
	}
	wrong := redis.NewClient(&redis.Options{Addr: s.addr, Password: "nope"})
	defer wrong.Close()
	if err := wrong.Ping(ctx).Err(); err == nil || !strings.Contains(err.Error(), "WRONGPASS") {
		t.Fatalf("want WRONGPASS, got %v", err)
	}
	ca, err := os.ReadFile(filepath.Join(pki, "ca.crt"))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	cert, err := tls.LoadX509KeyPair(filepath.Join(pki, "client.crt"), filepath.Join(pki, "client.key"))
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(&redis.Options{Addr: s.tlsAddr, Password: "go-secret",
		TLSConfig: &tls.Config{RootCAs: pool, Certificates: []tls.Certificate{cert}, ServerName: "localhost"}})
	defer c.Close()
	if err := c.Set(ctx, "k", "over tls", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if v := c.Get(ctx, "k").Val(); v != "over tls" {
		t.Fatalf("got %q", v)
	}
}

"""serve.py's page in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`, which
`sudo make browser` installs; make test never does) driven by selenium, against a server on random weights (a tiny
backbone) and a tiny pointmap checkpoint. The page loads, the bundled photo goes up through the file input, every
result picture renders, a click on a patch changes the attention heat map, and the browser logs no error. It skips,
with its reason, only where no browser can be had, never under CI=true (it fails there)."""

import json
import os
import shutil
import time

import pytest

import serve
from conftest import ROOT
from sapiens2 import Sapiens2Config
from test_predict import checkpoints  # noqa: F401 (a fixture)

PHOTO = ROOT / "assets" / "astronaut.jpg"
WAIT_S = 120
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                  "--window-size=1280,1500")
PICTURES = {"segmentation", "pose (hover a point)", "normals", "depth, from the pointmap", "matting"}


def unavailable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: the browser test must run)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def page_server(checkpoints, tmp_path_factory):  # noqa: F811 (the fixture)
    """Seg, pose, normal and matting on random weights (their 0.4b checkpoints cannot be downloaded offline: the
    tiny backbone stands in), pointmap from a tiny checkpoint: every picture kind, the random-weights banner."""
    import sapiens2

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sapiens2.PRESETS, "tiny", Sapiens2Config(32, 2, 2, full_attention_first=1,
                                                                full_attention_last=1, image_size=(64, 48)))
        patch.setenv("SAPIENS2_CACHE", str(tmp_path_factory.mktemp("empty_cache")))
        patch.setenv("HF_HUB_OFFLINE", "1")
        args = serve.build_parser().parse_args([
            "--port", "0", "--tasks", "seg,pose,normal,pointmap,matting", "--random-init", "fallback",
            "--random-backbone", "tiny", "--model", f"pointmap={checkpoints['pointmap']}"])
        service = serve.start(args).in_thread()
    yield service
    service.close()


@pytest.fixture
def browser(tmp_path):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        unavailable("selenium is not installed (pip install -r requirements-test.txt)")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        unavailable("no chromium and chromedriver here: `sudo make browser` installs them (Debian's chromium "
                    "chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium must not look for a browser to download
    session = webdriver.Chrome(options=options, service=Service(executable_path=driver))
    session.set_page_load_timeout(WAIT_S)
    try:
        yield session
    finally:
        session.quit()


def wait_until(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if result := condition():
            return result
        time.sleep(0.1)
    raise AssertionError(f"not within {WAIT_S} s: {what}")


def rendered(session, img) -> bool:
    return session.execute_script("return arguments[0].complete && arguments[0].naturalWidth > 0", img)


def test_the_page_in_a_real_browser(page_server, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    browser.get(page_server.url)
    wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#tasks input")) == 5, "the tasks offered")
    banner = browser.find_element(By.ID, "banner")
    assert banner.is_displayed() and "RANDOM WEIGHTS" in banner.text

    browser.find_element(By.ID, "photos").send_keys(str(PHOTO))
    browser.find_element(By.ID, "run").click()
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, ".photo .state.done"), "the photo's results")
    heat_map = browser.find_element(By.CSS_SELECTOR, ".att-map")
    wait_until(lambda: rendered(browser, heat_map), "the first heat map")
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "svg.norms polyline"), "the token norms plot")
    images = browser.find_elements(By.CSS_SELECTOR, ".photo img")
    wait_until(lambda: all(rendered(browser, img) for img in images), "every picture rendered")
    assert {img.get_attribute("alt") for img in images} == PICTURES | {"input photo", heat_map.get_attribute("alt")}
    assert len(browser.find_elements(By.CSS_SELECTOR, ".downloads a")) == 10  # every file, pictures or not

    caption = browser.find_element(By.CSS_SELECTOR, ".att-caption")
    browser.find_element(By.XPATH, "//button[text()='reg 0']").click()
    wait_until(lambda: "query register:0" in caption.text, "register 0's row")
    before = heat_map.get_attribute("src")
    width, height = heat_map.size["width"], heat_map.size["height"]
    # a sixth of the way from the top-left corner: in the top-left patch of the 4x3 grid (offsets from the centre)
    ActionChains(browser).move_to_element_with_offset(heat_map, -width // 3, -height // 3).click().perform()
    wait_until(lambda: "query patch:0,0" in caption.text, "the clicked patch's row")
    assert heat_map.get_attribute("src") != before and rendered(browser, heat_map)

    # hovering a drawn keypoint of the pose picture names a keypoint drawn there
    job, = page_server.app.store.jobs.values()
    pose = json.loads(job.files["astronaut.pose.json"].path.read_text())
    drawn = [(x, y, name) for person in pose["people"] for (x, y, score), name in
             zip(person["keypoints"], pose["keypoint_names"]) if score > 0.3]
    assert drawn, "no keypoint drawn to hover"
    x, y, _ = drawn[0]
    picture = browser.find_element(By.CSS_SELECTOR, "img[alt^='pose']")
    scale = picture.size["width"] / pose["width"]
    ActionChains(browser).move_to_element_with_offset(picture, round(x * scale - picture.size["width"] / 2),
                                                      round(y * scale - picture.size["height"] / 2)).perform()
    tooltip = browser.find_element(By.ID, "tooltip")
    wait_until(tooltip.is_displayed, "the keypoint's name")
    assert tooltip.text in {name for _, _, name in drawn}

    browser.save_screenshot(str(tmp_path / "serve.png"))
    assert (tmp_path / "serve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == [], errors
